"""`trl-lopti demo`: a real RL run on a real pretrained model, offline, on a laptop CPU, in a few minutes: SmolLM2-135M-
Instruct ([`~trl_lopti.models.get_smollm2`]) trained by [`LoptiGRPOTrainer`] (AR alpha=0.3 + Lopti eta=0.5) on
single-digit addition ([`trl_lopti.tasks.arithmetic`]), which it partly solves; held-out reward and greedy accuracy
before and after go to a table, `results.json` and `training_curve.png`. Without an accelerator: on the CPU, said."""

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from trl import ModelConfig

from .. import LoptiGRPOConfig, LoptiGRPOTrainer
from ..diagnostics.report import new_figure, save_figure
from ..models import get_smollm2
from ..tasks.arithmetic import build_train_dataset, evaluate_held_out, exact_answer_reward, split_problems
from .parsing import LoptiParser, check_model_name_or_path, check_model_reachable, cpu_settings
from .train import policy_model_init_kwargs


DEMO_TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/demo",
    # 4 prompts x 8 completions (num_generations) per generation batch.
    "per_device_train_batch_size": 32,
    # " 15." is 4 tokens; the first number is all the reward reads.
    "max_completion_length": 4,
    # Far above the paper's 1e-6: this run is 6 generation batches long.
    "learning_rate": 2e-5,
    "lr_scheduler_type": "constant",
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 0,
}
"""Defaults of `trl-lopti demo` for fields of `LoptiGRPOConfig` (flags and `--config` override them). The others keep
their `LoptiGRPOConfig` defaults: temperature 1 (top_k 0, top_p 1), beta 0, alpha 0.3, eta 0.5, no `report_to`."""


@dataclass
class DemoArguments:
    """The demo's own arguments (the trainer's are [`LoptiGRPOConfig`]'s, the model's TRL's `ModelConfig`'s)."""

    rollout_batches: int = field(default=6, metadata={"help": "Generation batches to train on."})
    num_eval_pairs: int = field(default=30, metadata={"help": "Held-out (a, b) pairs out of 100, never trained on."})
    eval_samples: int = field(default=4, metadata={"help": "Sampled answers per held-out prompt (mean reward)."})

    def __post_init__(self):
        if self.rollout_batches < 1 or self.eval_samples < 1:
            raise ValueError("rollout_batches and eval_samples: must be positive integers")
        if not 1 <= self.num_eval_pairs <= 99:
            raise ValueError(f"num_eval_pairs: must lie in [1, 99], got {self.num_eval_pairs}")


def make_parser():
    """The parser of `trl-lopti demo`: `(DemoArguments, LoptiGRPOConfig, ModelConfig)` with the demo's defaults."""
    parser = LoptiParser((DemoArguments, LoptiGRPOConfig, ModelConfig), "demo")
    parser.set_defaults(**DEMO_TRAINING_DEFAULTS)
    return parser


def format_table(before: dict[str, float], after: dict[str, float], temperature: float) -> str:
    """The before/after table as text."""
    rows = [(f"mean reward, sampled (T={temperature:g})", "reward"), ("accuracy, greedy", "accuracy")]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'held-out prompts (' + str(before['num_prompts']) + ')':<{width}}   before    after   change"]
    for name, key in rows:
        lines.append(f"{name:<{width}}   {before[key]:6.3f}   {after[key]:6.3f}   {after[key] - before[key]:+6.3f}")
    return "\n".join(lines)


def weight_change(initial: dict[str, torch.Tensor], model) -> dict[str, float]:
    """How far training moved the weights from `initial` (name -> tensor): the tensors that changed, and the relative
    change `||after - before|| / ||before||` over all of them."""
    after = {name: param.detach() for name, param in model.named_parameters()}
    moved = sum(float((after[name].double() - tensor.double()).square().sum()) for name, tensor in initial.items())
    norm = sum(float(tensor.double().square().sum()) for tensor in initial.values())
    changed = sum(not torch.equal(after[name], tensor) for name, tensor in initial.items())
    return {"changed_tensors": changed, "tensors": len(initial), "relative_change": math.sqrt(moved / norm)}


def plot_curve(path: Path, batches: list[int], rewards: list[float], before: dict, after: dict) -> str:
    """The training reward per generation batch, with the held-out reward before and after as lines; returns `path`."""
    figure, axis = new_figure(figsize=(6, 4))
    axis.plot(batches, rewards, marker="o", markersize=3, label="training reward")
    for color, (name, result) in enumerate((("before", before), ("after", after)), start=1):
        label = f"held-out reward {name}: {result['reward']:.2f}"
        axis.axhline(result["reward"], linestyle="--", color=f"C{color}", label=label)
    axis.set(xlabel="generation batch", ylabel="reward (1 = correct sum)", ylim=(-0.02, 1.02))
    axis.legend(fontsize=8)
    return save_figure(figure, path, "GRPO + AR + Lopti on single-digit addition")


def main(argv: Sequence[str]) -> int:
    """`trl-lopti demo [--field value ...]`: model, evaluation before, training, evaluation after, table, JSON, PNG."""
    cpu = {} if torch.accelerator.is_available() else {"use_cpu": True, "bf16": False}
    demo_args, training_args, model_args = make_parser().parse(argv, cpu and cpu_settings(argv, "trl-lopti demo", cpu))
    start = time.perf_counter()
    args = training_args
    rollout_batches = demo_args.rollout_batches
    model_path = check_model_name_or_path(model_args.model_name_or_path or get_smollm2())
    check_model_reachable(model_path, model_args.model_revision)
    train_problems, held_out = split_problems("add", demo_args.num_eval_pairs, split_seed=args.seed)
    prompts = rollout_batches * args.generation_batch_size // args.num_generations
    dataset = build_train_dataset(train_problems, prompts, args.seed)
    args.max_steps = math.ceil(rollout_batches * args.lopti_cycle_micro_steps / args.gradient_accumulation_steps)
    args.model_init_kwargs = policy_model_init_kwargs(args, model_args)
    trainer = LoptiGRPOTrainer(model=model_path, reward_funcs=exact_answer_reward, args=args, train_dataset=dataset)
    evaluation = (trainer.processing_class, held_out, exact_answer_reward, args.max_completion_length)
    # Sampled with another seed.
    evaluation += (args.temperature, demo_args.eval_samples, args.seed + 1)
    before = evaluate_held_out(trainer.model, *evaluation)
    print(f"before training: held-out reward {before['reward']:.3f}, accuracy {before['accuracy']:.3f}", flush=True)
    initial = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    train_start = time.perf_counter()
    trainer.train()
    timings = {"train": time.perf_counter() - train_start}
    moved = weight_change(initial, trainer.model)
    after = evaluate_held_out(trainer.model, *evaluation)
    timings["total"] = time.perf_counter() - start

    # TRL logs `reward` once per generation batch (Lopti's second pass logs none): one point per batch.
    rewards = [float(entry["reward"]) for entry in trainer.state.log_history if "reward" in entry]
    batches = list(range(1, len(rewards) + 1))
    output_dir = Path(training_args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "model": model_path,
        "task": "single-digit addition, answer pre-filled with 'The answer is'; reward 1 if the first number is a + b",
        "method": {name: getattr(training_args, name) for name in ("advantage_reweighting_alpha", "lopti_threshold")},
        "before": before,
        "after": after,
        "table": format_table(before, after, training_args.temperature),
        "weight_change": moved,
        "curve": {"generation_batch": batches, "reward": rewards},
        "optimizer_steps": trainer.state.global_step,
        "rollouts": rollout_batches * args.generation_batch_size,
        "timings_s": timings,
        "training_curve_png": plot_curve(output_dir / "training_curve.png", batches, rewards, before, after),
        "args": asdict(demo_args),
    }
    (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    # The table and the line after it: what the README shows (.ci/check_demo.py compares them).
    print(
        f"\n{results['table']}\n{results['rollouts']} rollouts, {results['optimizer_steps']} optimizer steps; weights "
        f"moved: {moved['changed_tensors']} of {moved['tensors']} tensors, ||after - before|| / ||before|| = "
        f"{moved['relative_change']:.3e}\n\nwall time {timings['total'] / 60:.1f} min (train "
        f"{timings['train'] / 60:.1f} min); wrote {output_dir / 'results.json'} and {results['training_curve_png']}"
    )
    return 0
