"""The benchmarks: short configurations of the harness (`harness.py`), one dataclass of options each, and their command
line (TRL's `TrlParser`). `benchmarks/README.md` says what each one measures and where its results are.

    python benchmarks/experiments.py cost --size tiny                      # seconds; tests/test_benchmark.py runs it
    python benchmarks/experiments.py compare --size smollm2 --seeds 0 1 2 3 4 --output-dir benchmarks/results
    python benchmarks/experiments.py isolation
    python benchmarks/experiments.py lm-head --low-share 0.2 --repeats 5
    python benchmarks/experiments.py EXPERIMENT --help                     # its options
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

import harness  # noqa: E402  (benchmarks/ is on sys.path when this file runs; tests load it by name)
import report  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402
from trl import TrlParser  # noqa: E402

from trl_lopti.core_algos import low_probability_token_mask, token_group_mask  # noqa: E402
from trl_lopti.diagnostics.report import markdown_table  # noqa: E402
from trl_lopti.tasks import arithmetic, token_parity_reward  # noqa: E402


METHODS: dict[str, dict[str, Any] | None] = {  # Lopti config fields; None: TRL's trainer (`algorithm_of`)
    # the paper's K&K settings (DESIGN.md, section 5); `cost` sets every fixed eta to its size's
    "grpo": None,
    "ar": dict(advantage_reweighting_alpha=0.2, lopti_threshold=None),
    "lopti": dict(advantage_reweighting_alpha=0.0, lopti_threshold=0.4),
    "ar+lopti": dict(advantage_reweighting_alpha=0.3, lopti_threshold=0.5),
    "lopti-quantile": dict(advantage_reweighting_alpha=0.0, lopti_threshold=None, lopti_quantile=0.5),
}
# the same settings on TRL's RLOOTrainer (`rloo`) and LoptiRLOOTrainer, which never adds a forward: RLOO computes pi_old
METHODS |= {"rloo": None, **{f"rloo-{name}": METHODS[name] for name in ("ar", "lopti", "ar+lopti")}}
# and on TRL's GMPOTrainer (`gmpo`, TRL >= 1.16.0) and the Lopti trainer composed with it as a user writes it
# (`harness.LoptiGMPOTrainer`): its loss is not GRPO's token-level one, so AR takes its general form there
METHODS |= {"gmpo": None, **{f"gmpo-{name}": METHODS[name] for name in ("ar", "lopti", "ar+lopti")}}


def algorithm_of(method: str) -> str:
    """The base algorithm (`harness.TRAINERS`) of a method of `METHODS`: `"rloo"` for `rloo` and `rloo-*`, `"gmpo"`
    for `gmpo` and `gmpo-*`, else `"grpo"`."""
    prefix = method.split("-")[0]
    return prefix if prefix in ("rloo", "gmpo") else "grpo"


@dataclass
class Options:
    output_dir: str = "benchmarks/results"
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: 1 where CUDA is absent)"})


# cost ----------------------------------------------------------------------------------------------------------------
_SMOLLM2_CPU = dict(
    model="smollm2",
    model_config={},
    device="cpu",
    prompts_per_batch=2,
    num_generations=4,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,  # = steps_per_generation: on-policy, one GRPO optimizer step per generation batch
    max_completion_length=128,  # longer than the prompts, as in RL: generation is the larger part of a GRPO step
    gradient_checkpointing=False,  # a 135M model has no memory pressure on CPU
    lopti_threshold=0.5,  # None: 1 / vocab, which splits a near-uniform random model's tokens in two non-empty groups
    warmup_batches=1,
    measured_batches=2,
    time_budget_s=None,
)
SIZES: dict[str, dict[str, Any]] = {
    # A random Qwen2 whose vocabulary is larger than the tiny tokenizer's (unknown ids decode to nothing, as on GPU)
    "tiny": {
        **_SMOLLM2_CPU,
        "model": "random-qwen2",
        "model_config": dict(hidden_size=64, vocab_size=1024, tie_word_embeddings=True),
        "prompts_per_batch": 4,
        "per_device_train_batch_size": 8,
        "max_completion_length": 12,
        "gradient_checkpointing": True,
        "lopti_threshold": None,
    },
    "smollm2-cpu": _SMOLLM2_CPU,
    # completions about as long as the prompts: loss+backward is the larger part of a GRPO step on CPU
    "smollm2-cpu-short": {**_SMOLLM2_CPU, "max_completion_length": 48},
    # Qwen2.5-1.5B's shape with random weights (nothing can be downloaded on the GPU machine); see run_gpu.sh.
    "gpu": {
        **_SMOLLM2_CPU,
        "model": "random-qwen2",
        "model_config": dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            vocab_size=151936,
            tie_word_embeddings=True,
            rope_theta=1_000_000.0,
        ),
        "device": "cuda",
        "prompts_per_batch": 16,
        "num_generations": 8,
        "per_device_train_batch_size": 32,
        "gradient_accumulation_steps": 4,
        "max_completion_length": 256,
        "gradient_checkpointing": True,
        "lopti_threshold": None,
        "time_budget_s": 360.0,  # no variant starts after 6 min (run_gpu.sh: 3.5 min, and stops the run at 5)
    },
}


@dataclass
class Cost(Options):
    """What AR and Lopti cost against the TRL trainer each variant extends (`GRPOTrainer`, `RLOOTrainer`,
    `GMPOTrainer`): each variant on one size, the same model, prompts and seed, one after the other in one process, the
    same number of generation batches (Lopti's `max_steps` doubled) of fixed-length completions (`min_new_tokens`).
    Writes `bench_<size>.json` (after every variant: a run cut short keeps what it measured) and `bench_<size>.md`;
    variants not started within the size's time budget, or whose trainer this TRL lacks (GMPO before 1.16.0), are
    listed as skipped. `None`: the size's value."""

    size: str = field(default="tiny", metadata={"choices": list(SIZES)})
    variants: list[str] = field(default_factory=lambda: list(METHODS), metadata={"choices": list(METHODS)})
    seed: int = 42
    warmup_batches: int | None = None
    measured_batches: int | None = None
    time_budget_s: float | None = None


def cost(args: Cost) -> dict[str, Any]:
    overrides = {key: getattr(args, key) for key in ("warmup_batches", "measured_batches", "time_budget_s")}
    size = {"name": args.size, **SIZES[args.size], **{k: v for k, v in overrides.items() if v is not None}}
    cuda = size["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"size {args.size!r} needs CUDA")
    json_path = Path(args.output_dir) / f"bench_{args.size}.json"
    num_batches, length = size["warmup_batches"] + size["measured_batches"], size["max_completion_length"]
    start = time.perf_counter()

    def save() -> None:  # after every variant, and once at the end (where every variant was skipped)
        data.update(load_average_at_end=os.getloadavg(), total_wall_s=time.perf_counter() - start)
        harness.write_json(json_path, data)
        json_path.with_suffix(".md").write_text(report.cost_markdown(data))

    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        model_path = harness.prepare_model(size["model"], Path(tmp), args.seed, size["device"], **size["model_config"])
        eta = size["lopti_threshold"] or 1.0 / AutoConfig.from_pretrained(model_path).vocab_size
        dataset = harness.addition_prompts(size["prompts_per_batch"] * num_batches, args.seed)
        data = harness.record(args, model_path, size=size, lopti_threshold=eta, runs=[], skipped=[])
        for name in args.variants:
            if size["time_budget_s"] is not None and time.perf_counter() - start > size["time_budget_s"]:
                data["skipped"].append(f"{name} (time budget of {size['time_budget_s']:g} s spent)")
                continue
            if algorithm_of(name) in harness.UNAVAILABLE:
                data["skipped"].append(f"{name} ({harness.UNAVAILABLE[algorithm_of(name)]})")
                continue
            lopti = METHODS[name]
            if lopti and lopti["lopti_threshold"] is not None:  # a fixed eta: the size's
                lopti = {**lopti, "lopti_threshold": eta}
            print(f"[cost] {name} ({time.perf_counter() - start:.0f} s elapsed)", flush=True)
            run = harness.measure_training(
                model_path,
                dataset,
                [harness.answer_reward, token_parity_reward],
                num_batches,
                lopti,
                algorithm=algorithm_of(name),
                per_device_train_batch_size=size["per_device_train_batch_size"],
                gradient_accumulation_steps=size["gradient_accumulation_steps"],
                num_generations=size["num_generations"],
                max_completion_length=length,
                generation_kwargs={"min_new_tokens": length},
                learning_rate=1e-6,
                temperature=1.0,
                use_cpu=not cuda,
                bf16=cuda,
                gradient_checkpointing=size["gradient_checkpointing"],
                seed=args.seed,
            )
            for index, batch in enumerate(run["batches"]):
                batch["warmup"] = index < size["warmup_batches"]
            run.update(
                name=name, lopti=lopti, baseline=algorithm_of(name), medians=report.batch_medians(run["batches"])
            )
            data["runs"].append(run)
            save()
    save()
    print(report.cost_markdown(data))
    return data


# compare -------------------------------------------------------------------------------------------------------------
_COMPARE_SMOLLM2 = dict(
    model="smollm2",
    task="mixed",
    reward="exact",
    rollout_batches=10,
    prompts_per_batch=4,
    num_generations=8,
    max_completion_length=4,
    learning_rate=2e-5,
    weight_decay=0.01,
    temperature=1.0,
    num_eval_per_family=16,
    eval_samples=4,
    seeds=[0, 1, 2],
)
COMPARE_SIZES: dict[str, dict[str, Any]] = {
    "smollm2": _COMPARE_SMOLLM2,
    # a random model never answers: `token_parity` gives it non-zero advantages
    "tiny": {
        **_COMPARE_SMOLLM2,
        "model": "random-qwen2",
        "reward": "token_parity",
        "rollout_batches": 2,
        "prompts_per_batch": 2,
        "num_generations": 4,
        "learning_rate": 1e-3,
        "num_eval_per_family": 2,
        "eval_samples": 2,
        "seeds": [0, 1],
    },
}


@dataclass
class Compare(Options):
    """Does it help? Methods on the arithmetic task of `trl_lopti.tasks.arithmetic`, several seeds (outermost; a seed
    fixes the prompts, their order and the sampling, the same for every method), equal rollouts: held-out greedy
    accuracy and sampled reward before and after, the training reward per batch, the paper's Fig.-3 statistic per
    `pi_old` quartile, and every figure's difference to GRPO paired by seed, with 95% Student-t intervals. Writes
    `compare_<size>.json` after every run, then `compare_<size>.md` and `compare_<size>.png`."""

    size: str = field(default="tiny", metadata={"choices": list(COMPARE_SIZES)})
    methods: list[str] = field(
        default_factory=lambda: ["grpo", "ar", "lopti", "ar+lopti"], metadata={"choices": list(METHODS)}
    )
    seeds: list[int] | None = None
    rollout_batches: int | None = None
    resume: bool = field(default=False, metadata={"help": "reuse the runs of compare_<size>.json of equal settings"})


def compare(args: Compare) -> dict[str, Any]:
    settings = {key: value for key, value in COMPARE_SIZES[args.size].items() if key != "seeds"}
    settings["rollout_batches"] = args.rollout_batches or settings["rollout_batches"]
    seeds = args.seeds or COMPARE_SIZES[args.size]["seeds"]
    json_path = Path(args.output_dir) / f"compare_{args.size}.json"
    previous = json.loads(json_path.read_text()) if args.resume and json_path.is_file() else {}
    finished = {(r["name"], r["seed"]): r for r in previous.get("runs", []) if previous["settings"] == settings}
    train_problems, held_out = arithmetic.split_problems(settings["task"], settings["num_eval_per_family"])
    reward = arithmetic.REWARDS[settings["reward"]]
    length, temperature = settings["max_completion_length"], settings["temperature"]
    with tempfile.TemporaryDirectory(prefix="compare-model-") as tmp:
        model_path = harness.prepare_model(settings["model"], Path(tmp))
        data = harness.record(args, model_path, settings=settings, seeds=seeds, num_heldout=len(held_out), runs=[])
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

        def evaluate(model, seed: int) -> dict[str, Any]:
            return arithmetic.evaluate_held_out(
                model, tokenizer, held_out, reward, length, temperature, settings["eval_samples"], seed=10_000 + seed
            )

        for seed in seeds:
            before = None
            for name in args.methods:
                if (name, seed) in finished:
                    data["runs"].append(finished[(name, seed)])
                    continue
                if before is None:  # every method starts from the same weights
                    before = evaluate(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), seed)

                def after_training(trainer, seed: int = seed) -> dict[str, Any]:
                    distance = parameter_distance(trainer.model, model_path)
                    return {"after": evaluate(trainer.model, seed), "parameter_distance": distance}

                run = harness.measure_training(
                    model_path,
                    arithmetic.build_train_dataset(
                        train_problems, settings["rollout_batches"] * settings["prompts_per_batch"], seed
                    ),
                    reward,
                    settings["rollout_batches"],
                    METHODS[name],
                    algorithm=algorithm_of(name),
                    fig3=True,
                    after_training=after_training,
                    processing_class=tokenizer,
                    seed=seed,
                    data_seed=seed,
                    use_cpu=True,
                    bf16=False,
                    learning_rate=settings["learning_rate"],
                    lr_scheduler_type="constant",
                    warmup_steps=0,
                    weight_decay=settings["weight_decay"],
                    gradient_accumulation_steps=1,
                    per_device_train_batch_size=settings["prompts_per_batch"] * settings["num_generations"],
                    num_generations=settings["num_generations"],
                    max_completion_length=length,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                )
                batches = run["batches"]
                run.update(
                    name=name,
                    seed=seed,
                    before=before,
                    fig3=report.fig3_shares(run["fig3_batches"]),
                    training_reward=[batch["logged"]["reward"][0] for batch in batches],
                    optimizer_steps=sum(batch["optimizer_steps"] for batch in batches),
                    generation_batches=len(batches),
                    probe_s=sum(batch["wall"]["probe_s"] for batch in batches),
                )
                data["runs"].append(run)
                print(
                    f"[compare] {name} seed {seed}: greedy {before['accuracy']:.3f} -> {run['after']['accuracy']:.3f}"
                    f", sampled {before['reward']:.3f} -> {run['after']['reward']:.3f}, {run['optimizer_steps']} "
                    f"optimizer steps / {len(batches)} batches, {run['train_cpu_s']:.0f} s CPU",
                    flush=True,
                )
                harness.write_json(json_path, data)
    data.update(summary=report.compare_summary(data["runs"]), load_average_at_end=os.getloadavg())
    harness.write_json(json_path, data)
    json_path.with_suffix(".md").write_text(report.compare_markdown(data))
    report.compare_plots(data, json_path.with_suffix(".png"))
    print(report.compare_markdown(data))
    return data


def parameter_distance(model, model_path: str) -> float:
    """`||theta - theta_0||_2`, theta_0 the weights saved in `model_path`."""
    initial = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    squares = (
        float(((p.detach().cpu().double() - initial[n].double()) ** 2).sum()) for n, p in model.named_parameters()
    )
    return math.sqrt(sum(squares))


# isolation -----------------------------------------------------------------------------------------------------------
ISOLATION_SETUPS = {
    "token-level dapo": dict(loss_type="dapo", importance_sampling_level="token"),
    "GSPO (sequence-level dapo)": dict(loss_type="dapo", importance_sampling_level="sequence"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
}


@dataclass
class Isolation(Options):
    """How much gradient a Lopti pass sends to its inactive tokens: summed `|dL/d log p|` over the low (active) and
    high (inactive) tokens at the policy's output in the first training forward (the low pass), for each loss setup,
    on one generation batch of a tiny random Qwen2 (4 completions of 7 tokens, eta = 1 / vocab, pi_old from the
    separate no-grad forward so that both runs split the same values), trained (a) by TRL's `GRPOTrainer` with every
    high token's advantage set to 0, (b) by `LoptiGRPOTrainer`. Writes `isolation.json`."""


def isolation(args: Isolation) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="isolation-") as tmp:
        model_path = harness.prepare_model("random-qwen2", Path(tmp))
        eta = 1.0 / AutoConfig.from_pretrained(model_path).vocab_size

        def zero_high_advantages(trainer, batch: dict[str, Any]) -> None:
            harness.add_old_logps_forward(trainer, batch)
            low = low_probability_token_mask(batch["old_per_token_logps"], batch["completion_mask"], eta)
            batch["advantages"] = torch.where(low, batch["advantages"][:, None], 0.0)  # token-level (B, T)

        rows = {}
        for name, setup in ISOLATION_SETUPS.items():
            rows[name] = []
            for lopti, hook in (
                (None, zero_high_advantages),
                (dict(advantage_reweighting_alpha=0.0, lopti_threshold=eta), harness.add_old_logps_forward),
            ):
                run = harness.measure_training(
                    model_path,
                    harness.addition_prompts(1, seed=0),
                    token_parity_reward,
                    1,
                    lopti,
                    after_scoring=hook,
                    capture_token_gradients=True,
                    per_device_train_batch_size=4,
                    gradient_accumulation_steps=1,
                    num_generations=4,
                    max_completion_length=7,
                    generation_kwargs={"min_new_tokens": 7},
                    temperature=0.7,
                    use_cpu=True,
                    bf16=False,
                    seed=0,
                    **setup,
                )
                inputs, log_probs = run["token_gradients"]
                gradient = log_probs.grad[:, -inputs["completion_ids"].size(1) :].abs()
                low = low_probability_token_mask(inputs["old_per_token_logps"], inputs["completion_mask"], eta)
                high = token_group_mask(low, inputs["completion_mask"], "high")
                rows[name] += [float(gradient[low].sum()), float(gradient[high].sum())]
        header = "setup | zeroed advantages: active | inactive | general form (LoptiGRPOTrainer): active | inactive"
        markdown = "\n".join(markdown_table(header, [[name, *sums] for name, sums in rows.items()]))
        data = harness.record(args, model_path, lopti_threshold=eta, summed_abs_grad=rows, markdown=markdown)
    harness.write_json(Path(args.output_dir) / "isolation.json", data)
    print(markdown)
    return data


# lm-head -------------------------------------------------------------------------------------------------------------
@dataclass
class LmHead(Options):
    """What an LM head computed only where a Lopti pass needs it could save (not in the trainer): process CPU time of
    forward+backward of one micro-batch (median of `repeats`, after one untimed round), four ways: `trl`, TRL's fused
    LM-head forward as `GRPOTrainer` calls it (on CPU it scores every position, prompt included); `full`, backbone +
    TRL's chunked log-prob kernel at every completion position (one pass today); `low`, the kernel without gradient at
    every completion position (the on-policy first pass needs all of pi_old to split), then with gradient at a random
    `low_share` of them; `high`, the kernel at the other positions only. At an inactive position the gradient reaching
    the LM head is exactly zero, so `(low + high) / full` is what a split Lopti's loss+backward would cost against one
    GRPO pass (today 2.0). Writes `lm_head_split_<model>_low<100 x low_share>.json`."""

    model: str = field(default="smollm2", metadata={"choices": ["smollm2", "random-qwen2"]})
    low_share: float = 0.2
    repeats: int = 3
    batch_size: int = 4
    prompt_length: int = 47
    completion_length: int = 48
    seed: int = 0


def lm_head_split(args: LmHead) -> dict[str, Any]:
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import add_fused_lm_head

    generator = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="lm-head-") as tmp:
        model_path = harness.prepare_model(args.model, Path(tmp), hidden_size=64)
        policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
        data = harness.record(args, model_path)
    add_fused_lm_head(policy, temperature=1.0, outputs=("log_probs", "entropy"))
    batch_size, length = args.batch_size, args.prompt_length + args.completion_length
    input_ids = torch.randint(0, policy.config.vocab_size, (batch_size, length), generator=generator)
    advantages = torch.randn(batch_size, 1, generator=generator).expand(batch_size, length - 1)
    completion = torch.zeros(batch_size, length - 1, dtype=torch.bool)
    completion[:, args.prompt_length - 1 :] = True  # the next-token positions that score completion tokens
    low = completion & (torch.rand(batch_size, length - 1, generator=generator) < args.low_share)
    weight = policy.get_output_embeddings().weight

    def kernel(hidden, positions):  # TRL's fused head at `positions`: log-probabilities and entropies, temperature 1
        ids, outputs = input_ids[:, 1:][positions], ("log_probs", "entropy")
        return ChunkedLogProbFunction.apply(hidden[positions], weight, None, ids, 1.0, 32768, None, 1.0, outputs)[0]

    def loss_backward(positions, scored_without_gradient=None):
        hidden = policy.base_model(input_ids=input_ids).last_hidden_state[:, :-1]
        if scored_without_gradient is not None:
            with torch.no_grad():
                kernel(hidden.detach(), scored_without_gradient)
        (-(kernel(hidden, positions) * advantages[positions]).sum()).backward()

    def trl_path():
        labels = input_ids.masked_fill(~torch.cat([torch.zeros(batch_size, 1, dtype=torch.bool), completion], 1), -100)
        log_probs = policy(input_ids=input_ids, labels=labels, fused_lm_head=True).log_probs  # (B, L - 1)
        (-(log_probs * advantages)[completion].sum()).backward()

    ways = {
        "trl": trl_path,
        "full": lambda: loss_backward(completion),
        "low": lambda: loss_backward(low, scored_without_gradient=completion),
        "high": lambda: loss_backward(completion & ~low),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(args.repeats + 1):
        for name, way in ways.items():
            policy.zero_grad(set_to_none=True)
            start = time.process_time()
            way()
            if repeat > 0:
                times[name].append(time.process_time() - start)
    cpu_s = {name: statistics.median(values) for name, values in times.items()}
    data.update(
        low_share=float(low.sum() / completion.sum()),
        cpu_s=cpu_s,
        samples_cpu_s=times,
        lopti_split_vs_one_pass_full=(cpu_s["low"] + cpu_s["high"]) / cpu_s["full"],
        one_pass_full_vs_trl_cpu_path=cpu_s["full"] / cpu_s["trl"],
    )
    name = f"lm_head_split_{args.model}_low{round(100 * args.low_share):03d}.json"
    harness.write_json(Path(args.output_dir) / name, data)
    print(json.dumps(data, indent=1))
    return data


# command line --------------------------------------------------------------------------------------------------------
EXPERIMENTS = {
    "cost": (Cost, cost),
    "compare": (Compare, compare),
    "isolation": (Isolation, isolation),
    "lm-head": (LmHead, lm_head_split),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the experiment `argv[0]` with the options that follow it (`--help`: its options)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in EXPERIMENTS:
        sys.exit(f"usage: python benchmarks/experiments.py {{{','.join(EXPERIMENTS)}}} [OPTIONS | --help]")
    options, experiment = EXPERIMENTS[argv[0]]
    parser = TrlParser(options, prog=f"experiments.py {argv[0]}", description=options.__doc__)
    (args,) = parser.parse_args_and_config(argv[1:])
    if args.threads or not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    return experiment(args)


if __name__ == "__main__":
    main()
