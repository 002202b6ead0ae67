"""The benchmarks: short configurations of the harness (`benchmarks/harness.py`), and their command line.

    python benchmarks/experiments.py cost --size tiny                      # seconds; tests/test_benchmark.py runs it
    python benchmarks/experiments.py cost --size smollm2-cpu-short --output-dir benchmarks/results
    python benchmarks/experiments.py compare --size smollm2 --seeds 0 1 2 3 4 --output-dir benchmarks/results
    python benchmarks/experiments.py isolation
    python benchmarks/experiments.py lm-head --low-share 0.24 --repeats 5

- `cost`: what AR and Lopti cost against TRL's `GRPOTrainer`: every variant of `VARIANTS` on one size of `SIZES`, the
  same model, prompts and seed, one after the other in one process, the same number of generation batches (Lopti's
  `max_steps` doubled), completions of fixed length (`min_new_tokens`). Writes `bench_<size>.json` after every
  variant and `bench_<size>.md`. Variants not started within the size's time budget are skipped and listed.
- `compare`: does it help? `METHODS` (GRPO and the paper's K&K settings of AR, Lopti, AR + Lopti) on the arithmetic
  task of `trl_lopti.tasks.arithmetic`, several seeds, equal rollouts; held-out greedy accuracy and sampled reward
  before and after, the training reward per batch, the paper's Fig.-3 statistic per `pi_old` quartile, and every
  figure's difference to GRPO paired by seed, with 95% Student-t intervals. Writes `compare_<size>.json` after every
  run, `compare_<size>.md` and `compare_<size>.png`; `--resume` reuses the finished runs of that JSON.
- `isolation`: how much gradient a Lopti pass sends to its inactive tokens, when they only get a zero advantage (TRL's
  `GRPOTrainer` with token-level advantages zeroed outside the low group) and with `LoptiGRPOTrainer` (gradient only
  through the active tokens): summed `|dL/d log p|` at the policy's output in the first training forward.
- `lm-head`: what an LM head computed only where a Lopti pass needs it could save (not in the trainer; one
  micro-batch, process CPU time of forward+backward).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
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

from trl_lopti.core_algos import low_probability_token_mask, token_group_mask  # noqa: E402
from trl_lopti.diagnostics.report import markdown_table  # noqa: E402
from trl_lopti.tasks import arithmetic, token_parity_reward  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------------
# cost
# ---------------------------------------------------------------------------------------------------------------------
ETA = "eta"  # in VARIANTS: the size's Lopti threshold

VARIANTS: dict[str, tuple[str, dict[str, Any] | None, bool]] = {
    # name: (description, LoptiGRPOConfig fields or None for TRL's GRPOTrainer, separate no-grad pi_old forward)
    "grpo": ("TRL GRPOTrainer", None, False),
    "ar": (
        "LoptiGRPOTrainer, AR only (alpha=0.2)",
        dict(advantage_reweighting_alpha=0.2, lopti_threshold=None),
        False,
    ),
    "lopti": ("LoptiGRPOTrainer, Lopti only", dict(advantage_reweighting_alpha=0.0, lopti_threshold=ETA), False),
    "ar+lopti": (
        "LoptiGRPOTrainer, AR (alpha=0.3) + Lopti",
        dict(advantage_reweighting_alpha=0.3, lopti_threshold=ETA),
        False,
    ),
    "lopti-refstyle": (
        "Lopti + separate old-log-prob forward (reference-style)",
        dict(advantage_reweighting_alpha=0.0, lopti_threshold=ETA),
        True,
    ),
    "lopti-quantile": (
        "Lopti, eta at the 0.5 quantile of each batch",
        dict(advantage_reweighting_alpha=0.0, lopti_threshold=None, lopti_quantile=0.5),
        False,
    ),
}

_SMOLLM2_CPU = dict(
    name="smollm2-cpu",
    model="smollm2",
    model_config={},
    device="cpu",
    bf16=False,
    threads=1,
    prompts_per_batch=2,
    num_generations=4,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_completion_length=128,  # longer than the prompts, as in RL: generation is the larger part of a GRPO step
    gradient_checkpointing=False,  # a 135M model has no memory pressure on CPU
    lopti_threshold=0.5,
    warmup_batches=1,
    measured_batches=2,
    time_budget_s=None,
)
SIZES: dict[str, dict[str, Any]] = {
    # A random Qwen2 whose vocabulary is larger than the tiny tokenizer's (unknown ids decode to nothing, as on GPU);
    # eta = 1 / vocab (None) splits a near-uniform random model's tokens in two non-empty groups.
    "tiny": {
        **_SMOLLM2_CPU,
        "name": "tiny",
        "model": "random-qwen2",
        "prompts_per_batch": 4,
        "per_device_train_batch_size": 8,
        "max_completion_length": 12,
        "gradient_checkpointing": True,
        "lopti_threshold": None,
        "model_config": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            tie_word_embeddings=True,
        ),
    },
    "smollm2-cpu": _SMOLLM2_CPU,
    # completions about as long as the prompts: loss+backward is the larger part of a GRPO step on CPU
    "smollm2-cpu-short": {**_SMOLLM2_CPU, "name": "smollm2-cpu-short", "max_completion_length": 48},
    # Qwen2.5-1.5B's shape with random weights (nothing can be downloaded on the GPU machine); see run_gpu.sh.
    "gpu": {
        **_SMOLLM2_CPU,
        "name": "gpu",
        "model": "random-qwen2",
        "device": "cuda",
        "bf16": True,
        "threads": None,
        "prompts_per_batch": 16,
        "num_generations": 8,
        "per_device_train_batch_size": 32,
        "gradient_accumulation_steps": 4,
        "max_completion_length": 256,
        "gradient_checkpointing": True,
        "lopti_threshold": None,
        "time_budget_s": 360.0,  # no variant starts after 6 min; run_gpu.sh stops at 7m50s
        "model_config": dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
        ),
    },
}


def cost(
    size: str = "tiny",
    variants: list[str] | None = None,
    output_dir: str = "benchmarks/results",
    seed: int = 42,
    command: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """
    Runs the cost experiment (module docstring); writes `bench_<size>.json` after every variant, and `bench_<size>.md`.

    Args:
        size (`str`, *optional*, defaults to `"tiny"`):
            A key of `SIZES`; `**overrides` change its entries (`warmup_batches`, `measured_batches`, `threads`,
            `time_budget_s`).
        variants (`list[str]`, *optional*):
            Keys of `VARIANTS`, in run order; all by default (`grpo` is needed for ratios).
        output_dir (`str`, *optional*, defaults to `"benchmarks/results"`), command (`str`, *optional*):
            Where the files go; the command line, recorded.
        seed (`int`, *optional*, defaults to `42`):
            Seed of the random model, the prompts, the trainers and the sampling.
    """
    size = {**SIZES[size], **overrides}
    cuda = size["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"size {size['name']!r} needs CUDA")
    json_path = Path(output_dir) / f"bench_{size['name']}.json"
    num_batches = size["warmup_batches"] + size["measured_batches"]
    length = size["max_completion_length"]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        model_path = harness.prepare_model(
            size["model"],
            Path(tmp),
            seed,
            size["device"],
            **({"max_position_embeddings": 4096, **size["model_config"]} if size["model"] == "random-qwen2" else {}),
        )
        model_config = AutoConfig.from_pretrained(model_path)
        eta = size["lopti_threshold"] or 1.0 / model_config.vocab_size
        dataset = harness.addition_prompts(size["prompts_per_batch"] * num_batches, seed)
        data: dict[str, Any] = {
            "experiment": "cost",
            "command": command,
            "size": size,
            "lopti_threshold": eta,
            "seed": seed,
            "model": "SmolLM2-135M-Instruct"
            if size["model"] == "smollm2"
            else (
                f"random Qwen2 (hidden {model_config.hidden_size}, {model_config.num_hidden_layers} layers, vocab "
                f"{model_config.vocab_size})"
            ),
            "environment": harness.environment(),
            "load_average_at_start": os.getloadavg(),
            "runs": [],
            "skipped": [],
        }
        for name in variants or list(VARIANTS):
            if size["time_budget_s"] is not None and time.perf_counter() - start > size["time_budget_s"]:
                data["skipped"].append(f"{name} (time budget of {size['time_budget_s']:g} s spent)")
                continue
            description, lopti, reference_style = VARIANTS[name]
            lopti = None if lopti is None else {key: eta if value == ETA else value for key, value in lopti.items()}
            print(f"[cost] {name} ({time.perf_counter() - start:.0f} s elapsed)", flush=True)
            run = harness.measure_training(
                model_path,
                dataset,
                [harness.answer_reward, token_parity_reward],
                num_batches,
                lopti,
                after_scoring=harness.add_old_logps_forward if reference_style else None,
                per_device_train_batch_size=size["per_device_train_batch_size"],
                gradient_accumulation_steps=size["gradient_accumulation_steps"],  # = steps_per_generation: on-policy
                num_generations=size["num_generations"],
                max_completion_length=length,
                generation_kwargs={"min_new_tokens": length},
                learning_rate=1e-6,
                temperature=1.0,
                use_cpu=not cuda,
                bf16=size["bf16"],
                gradient_checkpointing=size["gradient_checkpointing"],
                seed=seed,
            )
            for index, batch in enumerate(run["batches"]):
                batch["warmup"] = index < size["warmup_batches"]
            run.update(
                name=name,
                description=description,
                lopti=lopti,
                reference_style=reference_style,
                medians=report.batch_medians(run["batches"]),
            )
            data["runs"].append(run)
            data.update(load_average_at_end=os.getloadavg(), total_wall_s=time.perf_counter() - start)
            harness.write_json(json_path, data)  # after every variant: a run cut short keeps what it measured
            json_path.with_suffix(".md").write_text(report.cost_markdown(data))
    return data


# ---------------------------------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------------------------------
METHODS: dict[str, dict[str, Any] | None] = {  # the paper's K&K settings (DESIGN.md, section 5)
    "grpo": None,  # TRL's GRPOTrainer and GRPOConfig
    "ar": dict(advantage_reweighting_alpha=0.2, lopti_threshold=None),
    "lopti": dict(advantage_reweighting_alpha=0.0, lopti_threshold=0.4),
    "ar+lopti": dict(advantage_reweighting_alpha=0.3, lopti_threshold=0.5),
}
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


def compare(
    size: str = "tiny",
    methods: list[str] | None = None,
    output_dir: str = "benchmarks/results",
    resume: bool = False,
    command: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """
    Runs the method comparison (module docstring), seeds outermost; writes `compare_<size>.json` after every run, then
    `compare_<size>.md` and `compare_<size>.png`.

    Args:
        size (`str`, *optional*, defaults to `"tiny"`):
            A key of `COMPARE_SIZES`; `**overrides` change its settings (`seeds`, `rollout_batches`, ...).
        methods (`list[str]`, *optional*):
            Keys of `METHODS`, in run order; all by default.
        output_dir (`str`, *optional*, defaults to `"benchmarks/results"`), command (`str`, *optional*):
            Where the files go; the command line, recorded.
        resume (`bool`, *optional*, defaults to `False`):
            Reuse the runs of an existing `compare_<size>.json` made with the same settings.
    """
    settings = {**COMPARE_SIZES[size], **overrides}
    seeds = settings.pop("seeds")
    json_path = Path(output_dir) / f"compare_{size}.json"
    previous = json.loads(json_path.read_text()) if resume and json_path.is_file() else {}
    finished = {(r["name"], r["seed"]): r for r in previous.get("runs", []) if previous["settings"] == settings}
    train_problems, held_out = arithmetic.split_problems(settings["task"], settings["num_eval_per_family"])
    reward = arithmetic.REWARDS[settings["reward"]]
    length, temperature = settings["max_completion_length"], settings["temperature"]
    data: dict[str, Any] = {
        "experiment": "compare",
        "command": command,
        "settings": settings,
        "seeds": seeds,
        "num_heldout": len(held_out),
        "environment": harness.environment(),
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="compare-model-") as tmp:
        model_path = harness.prepare_model(settings["model"], Path(tmp))
        data["model"] = "SmolLM2-135M-Instruct" if settings["model"] == "smollm2" else "tiny random Qwen2"
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

        def evaluate(model, seed: int) -> dict[str, Any]:
            return arithmetic.evaluate_held_out(
                model, tokenizer, held_out, reward, length, temperature, settings["eval_samples"], seed=10_000 + seed
            )

        config = dict(
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
        num_prompts = settings["rollout_batches"] * settings["prompts_per_batch"]
        for seed in seeds:  # a seed fixes the prompts, their order and the sampling, the same for every method
            before = None
            for name in methods or list(METHODS):
                if (name, seed) in finished:
                    data["runs"].append(finished[(name, seed)])
                    continue
                if before is None:  # every method starts from the same weights
                    before = evaluate(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), seed)

                def after_training(trainer, seed: int = seed) -> dict[str, Any]:
                    return {
                        "after": evaluate(trainer.model, seed),
                        "parameter_distance": parameter_distance(trainer.model, model_path),
                    }

                dataset = arithmetic.build_train_dataset(train_problems, num_prompts, seed)
                run = harness.measure_training(
                    model_path,
                    dataset,
                    reward,
                    settings["rollout_batches"],
                    METHODS[name],
                    fig3=True,
                    after_training=after_training,
                    processing_class=tokenizer,
                    seed=seed,
                    data_seed=seed,
                    **config,
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
    return data


def parameter_distance(model, model_path: str) -> float:
    """`||theta - theta_0||_2` over the parameters saved in `model_path` (the starting weights)."""
    from safetensors.torch import load_file

    current = dict(model.named_parameters())
    total = sum(
        float(((current[name].detach().double().cpu() - initial.double()) ** 2).sum())
        for path in sorted(Path(model_path).glob("*.safetensors"))
        for name, initial in load_file(str(path)).items()
        if name in current
    )
    return math.sqrt(total)


# ---------------------------------------------------------------------------------------------------------------------
# isolation
# ---------------------------------------------------------------------------------------------------------------------
ISOLATION_SETUPS = {
    "token-level dapo": dict(loss_type="dapo", importance_sampling_level="token"),
    "GSPO (sequence-level dapo)": dict(loss_type="dapo", importance_sampling_level="sequence"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
}


def isolation(output_dir: str = "benchmarks/results", command: str | None = None) -> dict[str, Any]:
    """
    Summed `|dL/d log p|` over the low (active) and high (inactive) tokens of a low pass, for each loss setup: one
    generation batch of a tiny random Qwen2 (4 completions of 7 tokens, eta = 1 / vocab, pi_old from the separate
    no-grad forward so that both runs split the same values) trained (a) by TRL's `GRPOTrainer` with every high token's
    advantage set to 0, (b) by `LoptiGRPOTrainer`; read at the policy's output in the first training forward.
    """
    with tempfile.TemporaryDirectory(prefix="isolation-") as tmp:
        model_path = harness.prepare_model("random-qwen2", Path(tmp))
        eta = 1.0 / AutoConfig.from_pretrained(model_path).vocab_size
        common = dict(
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
            num_generations=4,
            max_completion_length=7,
            generation_kwargs={"min_new_tokens": 7},
            temperature=0.7,
            use_cpu=True,
            bf16=False,
            seed=0,
            learning_rate=1e-6,
            capture_token_gradients=True,
        )

        def zero_high_advantages(trainer, batch: dict[str, Any]) -> None:
            harness.add_old_logps_forward(trainer, batch)
            low = low_probability_token_mask(batch["old_per_token_logps"], batch["completion_mask"], eta)
            batch["advantages"] = torch.where(low, batch["advantages"][:, None], 0.0)  # token-level (B, T)

        rows = {}
        for name, setup in ISOLATION_SETUPS.items():
            sums = []
            for lopti, after_scoring in (
                (None, zero_high_advantages),
                (dict(advantage_reweighting_alpha=0.0, lopti_threshold=eta), harness.add_old_logps_forward),
            ):
                run = harness.measure_training(
                    model_path,
                    harness.addition_prompts(1, seed=0),
                    token_parity_reward,
                    1,
                    lopti,
                    after_scoring=after_scoring,
                    **common,
                    **setup,
                )
                inputs, log_probs = run["token_gradients"]
                gradient = log_probs.grad[:, -inputs["completion_ids"].size(1) :].abs()
                low = low_probability_token_mask(inputs["old_per_token_logps"], inputs["completion_mask"], eta)
                sums += [
                    float(gradient[low].sum()),
                    float(gradient[token_group_mask(low, inputs["completion_mask"], "high")].sum()),
                ]
            rows[name] = sums
    header = "setup | zeroed advantages: active | inactive | general form (LoptiGRPOTrainer): active | inactive"
    markdown = "\n".join(markdown_table(header, [[name, *sums] for name, sums in rows.items()]))
    data = {
        "experiment": "isolation",
        "command": command,
        "lopti_threshold": eta,
        "summed_abs_grad": rows,
        "columns": header.split(" | ")[1:],
        "markdown": markdown,
    }
    harness.write_json(Path(output_dir) / "isolation.json", data)
    print(markdown)
    return data


# ---------------------------------------------------------------------------------------------------------------------
# lm-head
# ---------------------------------------------------------------------------------------------------------------------
def lm_head_split(
    model: str = "smollm2",
    batch_size: int = 4,
    prompt_length: int = 47,
    completion_length: int = 48,
    low_share: float = 0.2,
    repeats: int = 3,
    seed: int = 0,
    output_dir: str = "benchmarks/results",
) -> dict[str, Any]:
    """
    Process CPU time of forward+backward of one micro-batch (median of `repeats`, after one untimed round), four ways:
    `trl`, TRL's fused LM-head forward as `GRPOTrainer` calls it (on CPU it scores every position, prompt included);
    `full`, backbone + TRL's chunked log-prob kernel at every completion position (one pass today); `low`, the kernel
    without gradient at every completion position (the on-policy first pass needs all of pi_old to split), then with
    gradient at a random `low_share` of them; `high`, the kernel at the other positions only. At an inactive position
    the gradient reaching the LM head is exactly zero, so `(low + high) / full` is what a split Lopti's loss+backward
    would cost against one GRPO pass (today 2.0).
    """
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import add_fused_lm_head

    generator = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="lm-head-") as tmp:
        kind = "smollm2" if model == "smollm2" else "random-qwen2"
        policy = AutoModelForCausalLM.from_pretrained(
            harness.prepare_model(kind, Path(tmp), hidden_size=64), dtype=torch.float32
        ).train()
    add_fused_lm_head(policy, temperature=1.0, outputs=("log_probs", "entropy"))
    length = prompt_length + completion_length
    input_ids = torch.randint(0, policy.config.vocab_size, (batch_size, length), generator=generator)
    advantages = torch.randn(batch_size, 1, generator=generator).expand(batch_size, length - 1)
    completion = torch.zeros(batch_size, length - 1, dtype=torch.bool)
    completion[:, prompt_length - 1 :] = True  # the next-token positions that score completion tokens
    low = completion & (torch.rand(batch_size, length - 1, generator=generator) < low_share)
    weight = policy.get_output_embeddings().weight

    def kernel(hidden, positions):
        return ChunkedLogProbFunction.apply(
            hidden[positions],
            weight,
            None,
            input_ids[:, 1:][positions],
            1.0,
            32768,
            None,
            1.0,
            ("log_probs", "entropy"),
        )[0]

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
    for repeat in range(repeats + 1):
        for name, way in ways.items():
            policy.zero_grad(set_to_none=True)
            start = time.process_time()
            way()
            if repeat > 0:
                times[name].append(time.process_time() - start)
    cpu_s = {name: statistics.median(values) for name, values in times.items()}
    data = {
        "experiment": "lm-head",
        "model": model,
        "batch_size": batch_size,
        "prompt_length": prompt_length,
        "completion_length": completion_length,
        "low_share": float(low.sum() / completion.sum()),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "cpu_s": cpu_s,
        "samples_cpu_s": times,
        "lopti_split_vs_one_pass_full": (cpu_s["low"] + cpu_s["high"]) / cpu_s["full"],
        "one_pass_full_vs_trl_cpu_path": cpu_s["full"] / cpu_s["trl"],
    }
    harness.write_json(Path(output_dir) / f"lm_head_split_{model}.json", data)
    print(json.dumps(data, indent=1))
    return data


# ---------------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses the command line (see the module docstring) and runs one experiment."""
    argv = sys.argv[1:] if argv is None else argv
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--output-dir", default="benchmarks/results")
    common.add_argument("--threads", type=int, default=None, help="torch threads (default: the size's, else 1)")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    experiments = parser.add_subparsers(dest="experiment", required=True)
    parser_cost = experiments.add_parser("cost", parents=[common], help="cost of AR and Lopti against GRPOTrainer")
    parser_cost.add_argument("--size", default="tiny", choices=list(SIZES))
    parser_cost.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS))
    parser_cost.add_argument("--seed", type=int, default=42)
    parser_cost.add_argument("--warmup-batches", type=int, default=None)
    parser_cost.add_argument("--measured-batches", type=int, default=None)
    parser_cost.add_argument("--time-budget-s", type=float, default=None)
    parser_compare = experiments.add_parser("compare", parents=[common], help="GRPO, AR, Lopti, AR + Lopti by seed")
    parser_compare.add_argument("--size", default="tiny", choices=list(COMPARE_SIZES))
    parser_compare.add_argument("--methods", nargs="+", default=None, choices=list(METHODS))
    parser_compare.add_argument("--seeds", nargs="+", type=int, default=None)
    parser_compare.add_argument("--rollout-batches", type=int, default=None)
    parser_compare.add_argument("--resume", action="store_true", help="reuse finished runs of compare_<size>.json")
    experiments.add_parser("isolation", parents=[common], help="gradient to inactive tokens: zeroed A vs Lopti")
    parser_head = experiments.add_parser("lm-head", parents=[common], help="an LM head only where a pass needs it")
    parser_head.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser_head.add_argument("--low-share", type=float, default=0.2)
    parser_head.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    given = {key: value for key, value in vars(args).items() if value is not None}
    threads = args.threads or (SIZES[args.size]["threads"] if args.experiment == "cost" else 1)
    if threads:
        torch.set_num_threads(threads)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    command = shlex.join(["python", "benchmarks/experiments.py", *argv])
    if args.experiment == "isolation":
        return isolation(args.output_dir, command)
    if args.experiment == "lm-head":
        return lm_head_split(args.model, low_share=args.low_share, repeats=args.repeats, output_dir=args.output_dir)
    if args.experiment == "cost":
        overrides = {
            key: given[key] for key in ("warmup_batches", "measured_batches", "time_budget_s") if key in given
        }
        data = cost(args.size, args.variants, args.output_dir, args.seed, command, threads=threads, **overrides)
        print(report.cost_markdown(data))
    else:
        overrides = {key: given[key] for key in ("seeds", "rollout_batches") if key in given}
        data = compare(args.size, args.methods, args.output_dir, args.resume, command, **overrides)
        print(report.compare_markdown(data))
    return data


if __name__ == "__main__":
    main()
