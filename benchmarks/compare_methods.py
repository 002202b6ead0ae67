"""Does it help? TRL's `GRPOTrainer` against AR, Lopti and AR + Lopti, side by side, over several seeds.

One command trains, on the same model, the same prompts, the same rollout budget and the same seeds, one run after
the other in one process:

| name | trainer | settings (the paper's K&K values, DESIGN.md section 5) |
|---|---|---|
| `grpo` | TRL's own `GRPOTrainer` with a plain `GRPOConfig` | - |
| `ar` | `trl_lopti.LoptiGRPOTrainer` | `advantage_reweighting_alpha=0.2`, `lopti_threshold=None` |
| `lopti` | `trl_lopti.LoptiGRPOTrainer` | `advantage_reweighting_alpha=0.0`, `lopti_threshold=0.4` |
| `ar+lopti` | `trl_lopti.LoptiGRPOTrainer` | `advantage_reweighting_alpha=0.3`, `lopti_threshold=0.5` |

Equal rollout budget: every run trains the same number of generation batches (`rollout_batches`) of the same size.
Lopti trains each generation batch twice (low-probability tokens, then the others), so its `max_steps` is twice
GRPO's: equal generation batches, not equal optimizer steps (see the README's schedule section). Both counts are
measured (a counter of `_generate_and_score_completions` calls during training and a callback on optimizer steps),
not inferred from the configuration.

The task is single-digit arithmetic with the answer pre-filled ("What is 7 - 3? The answer is"), reward 1 when the
first integer of the completion is the result, else 0. `--task` picks the families: `add` (a + b), `sub` (a - b,
a >= b), `mul` (a * b), `add3` (a + b + c), or `mixed` (all four, sampled evenly by family). Held-out problems
(a fixed split, the same for every seed) are never trained on.

Per run it measures:

- held-out greedy accuracy and mean sampled reward (temperature of training), before and after training (the
  "before" figures are measured once per seed: every method starts from the same weights);
- the training reward of every generation batch (the learning curve);
- the paper's Fig.-3 statistic on every generation batch: the per-token log-probabilities of the batch's completion
  tokens are scored right after generation (at the parameters that generated them, `pi_old`) and again right before
  the next generation batch (or at the end of training), i.e. after the last optimizer step trained on that batch
  (for Lopti: after both passes). Tokens are grouped by `pi_old` quartile over the batch's completion tokens (Q1 =
  `[min, e1)`, ..., Q4 = `[e3, max]`) and by the sign of their advantage; the counts of positive-advantage tokens
  whose probability rose and of negative-advantage tokens whose probability fell are summed over batches. The
  scoring is a no-grad forward of the same model (`log_softmax(logits / temperature)` at the sampled tokens), not a
  second GRPO implementation; its time is recorded apart (`probe_s`) and is the same work for every method;
- wall-clock and process CPU time of training;
- the distance `||theta_end - theta_0||` of the trained parameters from the starting ones, and the optimizer steps.

Across seeds, every figure gets its mean and a 95% Student-t interval (`mean +- t_{0.975, n-1} * sd / sqrt(n)`).
Outputs (under `--output-dir`): `compare_methods.json` (top-level `seeds`, `command`, per-method results and every
run), `compare_methods.md` (tables), `compare_methods_curves.png`, `compare_methods_fig3.png`,
`compare_methods_heldout.png`, and one JSON per finished run under `compare_methods_runs/`, written as soon as the
run ends, so that a stopped benchmark keeps its data; a rerun with the same settings skips finished runs
(`--no-resume` to redo them).

Sizes: `tiny` (a random tiny Qwen2 from `trl_lopti.models.build_tiny_model`, seconds; used by
`tests/test_compare_methods.py`; a random model never answers, so this size uses the shaped `digits` reward to have
non-zero advantages) and `smollm2` (SmolLM2-135M-Instruct, offline, see `trl_lopti.models.get_smollm2`).

Usage:

    python benchmarks/compare_methods.py --size smollm2 --task mixed --seeds 0 1 2 3 4 --rollout-batches 10 --threads 1
    python benchmarks/compare_methods.py --size tiny --output-dir /tmp/compare
    python benchmarks/compare_methods.py --report-only --output-dir benchmarks/results   # rebuild outputs from runs
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_lopti.diagnostics import completion_log_probs, probability_quartiles
from trl_lopti.tasks.arithmetic import (
    ANSWER_PREFIX,
    REWARDS,
    TASKS,
    build_train_dataset,
    evaluate_held_out,
    family_problems,
    split_problems,
)


# ---------------------------------------------------------------------------------------------------------------------
# Methods and sizes
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """
    One trainer configuration of the comparison.

    Args:
        name (`str`):
            Short name used in tables and file names.
        advantage_reweighting_alpha (`float`):
            AR's alpha (0 disables AR).
        lopti_threshold (`float` or `None`):
            Lopti's eta (`None` disables Lopti).
        plain_trl (`bool`):
            Train with TRL's own `GRPOTrainer` and `GRPOConfig` instead of `LoptiGRPOTrainer`.
    """

    name: str
    advantage_reweighting_alpha: float = 0.0
    lopti_threshold: float | None = None
    plain_trl: bool = False



METHODS: dict[str, Method] = {
    "grpo": Method("grpo", plain_trl=True),
    "ar": Method("ar", advantage_reweighting_alpha=0.2),
    "lopti": Method("lopti", lopti_threshold=0.4),
    "ar+lopti": Method("ar+lopti", advantage_reweighting_alpha=0.3, lopti_threshold=0.5),
}


@dataclass
class CompareArguments:
    """
    Settings of the comparison.

    Args:
        size (`str`, *optional*, defaults to `"tiny"`):
            `"tiny"` (random tiny model, seconds) or `"smollm2"` (SmolLM2-135M-Instruct, offline).
        task (`str`, *optional*, defaults to `"mixed"`):
            Problem families: `add`, `sub`, `mul`, `add3` or `mixed` (all four).
        reward (`str`, *optional*, defaults to `"exact"`):
            `"exact"` (1 if the first integer is the result) or `"digits"` (share of digit characters in the
            completion; a shaped reward for the tiny random model, which never answers).
        methods (`list[str]`, *optional*):
            Methods to run, in order; defaults to all of `METHODS`.
        seeds (`list[int]`, *optional*, defaults to `[0, 1, 2]`):
            Seeds; each seed fixes the training prompts, their order, the sampling and the initialisation of
            everything random, identically for every method.
        rollout_batches (`int`, *optional*, defaults to `10`):
            Generation batches per run (equal for every method).
        prompts_per_batch (`int`, *optional*, defaults to `4`):
            Prompts per generation batch.
        num_generations (`int`, *optional*, defaults to `8`):
            Completions per prompt (the GRPO group).
        max_completion_length (`int`, *optional*, defaults to `4`):
            Tokens per completion.
        learning_rate (`float`, *optional*, defaults to `2e-5`):
            Constant AdamW learning rate.
        weight_decay (`float`, *optional*, defaults to `0.01`):
            AdamW weight decay (the paper's value).
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature of training and of the sampled evaluation.
        num_eval_per_family (`int`, *optional*, defaults to `16`):
            Held-out problems per family.
        eval_samples (`int`, *optional*, defaults to `4`):
            Sampled answers per held-out problem.
        threads (`int`, *optional*, defaults to `1`):
            Torch CPU threads (on a CPU shared with other jobs, more threads than free cores slow torch down a lot).
        model_path (`str`, *optional*):
            A local model folder to use instead of the size's model.
        output_dir (`str`, *optional*, defaults to `"benchmarks/results"`):
            Output folder.
        resume (`bool`, *optional*, defaults to `True`):
            Skip runs whose result file exists with the same settings.
    """

    size: str = field(default="tiny", metadata={"help": "'tiny' (random tiny model) or 'smollm2'."})
    task: str = field(default="mixed", metadata={"help": "add, sub, mul, add3 or mixed."})
    reward: str = field(default="exact", metadata={"help": "'exact' or 'digits' (shaped, for the tiny model)."})
    methods: list[str] = field(default_factory=lambda: list(METHODS), metadata={"help": "Methods, in run order."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Seeds (same for every method)."})
    rollout_batches: int = field(default=10, metadata={"help": "Generation batches per run."})
    prompts_per_batch: int = field(default=4, metadata={"help": "Prompts per generation batch."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt."})
    max_completion_length: int = field(default=4, metadata={"help": "Tokens per completion."})
    learning_rate: float = field(default=2e-5, metadata={"help": "Constant AdamW learning rate."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (training and sampled eval)."})
    num_eval_per_family: int = field(default=16, metadata={"help": "Held-out problems per family."})
    eval_samples: int = field(default=4, metadata={"help": "Sampled answers per held-out problem."})
    threads: int = field(default=1, metadata={"help": "Torch CPU threads."})
    model_path: str | None = field(default=None, metadata={"help": "Local model folder (overrides the size's)."})
    output_dir: str = field(default="benchmarks/results", metadata={"help": "Output folder."})
    resume: bool = field(default=True, metadata={"help": "Skip runs already finished with the same settings."})

    def __post_init__(self):
        if self.size not in ("tiny", "smollm2"):
            raise ValueError(f"size must be 'tiny' or 'smollm2', got {self.size!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {sorted(REWARDS)}, got {self.reward!r}")
        unknown = [name for name in self.methods if name not in METHODS]
        if unknown or not self.methods or len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must be distinct names among {list(METHODS)}, got {self.methods!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be a non-empty list of distinct integers, got {self.seeds!r}")
        for name in ("rollout_batches", "prompts_per_batch", "max_completion_length", "num_eval_per_family",
                     "eval_samples", "threads"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer (>= 1), got {getattr(self, name)!r}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (GRPO compares completions), got {self.num_generations}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.weight_decay < 1:
            raise ValueError(f"weight_decay must lie in [0, 1), got {self.weight_decay}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        for family in TASKS[self.task]:
            available = len(family_problems(family))
            if self.num_eval_per_family >= available:
                raise ValueError(
                    f"num_eval_per_family must leave training problems in family {family!r}: allowed range "
                    f"[1, {available - 1}], got {self.num_eval_per_family}"
                )

    def run_settings(self) -> dict[str, Any]:
        """The settings that determine a run's result (a finished run is reused only if they match)."""
        keys = ("size", "task", "reward", "rollout_batches", "prompts_per_batch", "num_generations",
                "max_completion_length", "learning_rate", "weight_decay", "temperature", "num_eval_per_family",
                "eval_samples", "model_path")  # fmt: skip
        return {key: getattr(self, key) for key in keys}


TINY_DEFAULTS = dict(rollout_batches=2, prompts_per_batch=2, num_generations=4, num_eval_per_family=2,
                     eval_samples=2, seeds=[0, 1], reward="digits", learning_rate=1e-3)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# The Fig.-3 probe: a trainer hook, not a second GRPO implementation
# ---------------------------------------------------------------------------------------------------------------------
SIGNS = ("positive", "negative")


def shift_counts(logps_before, logps_after, advantages, mask) -> dict[str, Any]:
    """
    The Fig.-3 counts of one generation batch.

    Args:
        logps_before (`torch.Tensor`):
            Log-probabilities at `pi_old` (when the batch was generated), shape (B, T).
        logps_after (`torch.Tensor`):
            Log-probabilities after the last optimizer step trained on the batch, shape (B, T).
        advantages (`torch.Tensor`):
            Per-completion advantages, shape (B,) (the sign is what matters; AR does not change it).
        mask (`torch.Tensor`):
            Completion mask, shape (B, T).

    Returns:
        `dict`: `edges` and, per sign (`positive`, `negative`), per quartile (lists of 4): `count` (tokens),
        `in_direction` (probability rose for positive, fell for negative), `against` (the opposite), and
        `sum_delta_prob` (sum over the tokens of `p_after - p_before`).
    """
    import torch

    edges, group = probability_quartiles(logps_before.exp(), mask)
    edges = edges.tolist()
    delta = (logps_after - logps_before).double()
    delta_prob = logps_after.double().exp() - logps_before.double().exp()
    sign = torch.sign(advantages.double()).view(-1, 1).expand_as(delta)
    counts: dict[str, Any] = {"edges": edges}
    for name, sign_value, direction in (("positive", 1.0, 1.0), ("negative", -1.0, -1.0)):
        entry = {"count": [], "in_direction": [], "against": [], "sum_delta_prob": []}
        for quartile in range(4):
            tokens = (group == quartile) & (sign == sign_value)
            entry["count"].append(int(tokens.sum()))
            entry["in_direction"].append(int((tokens & (delta * direction > 0)).sum()))
            entry["against"].append(int((tokens & (delta * direction < 0)).sum()))
            entry["sum_delta_prob"].append(float(delta_prob[tokens].sum()))
        counts[name] = entry
    counts["zero_advantage_tokens"] = int((mask.bool() & (sign == 0)).sum())
    return counts


class Fig3ProbeMixin:
    """
    Trainer mixin: records every training generation batch and its Fig.-3 counts, and counts optimizer steps.

    `_generate_and_score_completions` is called by TRL once per generation batch, after the last optimizer step of
    the previous batch (for Lopti: after both passes). At that moment the hook first re-scores the previous batch
    (its "after" log-probabilities), then lets TRL generate the new batch and scores it at the same parameters (its
    `pi_old`). [`Fig3ProbeMixin.finish_probe`] re-scores the last batch after training.
    """

    def _init_probe(self) -> None:
        self.probe_batches: list[dict[str, Any]] = []  # per generation batch: counts, rewards, token statistics
        self.probe_seconds = 0.0
        self.generation_batches = 0
        self._probe_pending: dict[str, Any] | None = None
        self.probe_last_scores: tuple[dict[str, Any], Any] | None = None

    def _generate_and_score_completions(self, inputs):
        training = self.model.training
        if training:
            self._probe_rescore_pending()
        batch = super()._generate_and_score_completions(inputs)
        if training:
            self.generation_batches += 1
            start = time.perf_counter()
            self._probe_pending = {
                "prompt_ids": batch["prompt_ids"].detach(),
                "prompt_mask": batch["prompt_mask"].detach(),
                "completion_ids": batch["completion_ids"].detach(),
                "completion_mask": batch["completion_mask"].detach(),
                "advantages": batch["advantages"].detach().cpu(),
            }
            logps_before = completion_log_probs(self.model, self._probe_pending, self.temperature)
            self._probe_pending["logps_before"] = logps_before.cpu()
            self.probe_seconds += time.perf_counter() - start
        return batch

    def _probe_rescore_pending(self) -> None:
        if self._probe_pending is None:
            return
        start = time.perf_counter()
        pending, self._probe_pending = self._probe_pending, None
        logps_after = completion_log_probs(self.model, pending, self.temperature).cpu()
        self.probe_last_scores = (pending, logps_after)  # kept for inspection (tests), not reported
        mask = pending["completion_mask"].cpu()
        counts = shift_counts(pending["logps_before"], logps_after, pending["advantages"], mask)
        counts["completion_tokens"] = int(mask.sum())
        counts["first_completion_ids"] = pending["completion_ids"][0].tolist()
        self.probe_batches.append(counts)
        self.probe_seconds += time.perf_counter() - start

    def finish_probe(self) -> None:
        """Re-scores the last generation batch (call after `train()`)."""
        self._probe_rescore_pending()


def make_probed_trainer_classes():
    """The two trainers of the comparison with the probe mixed in: TRL's `GRPOTrainer` and `LoptiGRPOTrainer`."""
    from trl import GRPOTrainer

    from trl_lopti import LoptiGRPOTrainer

    class ProbedGRPOTrainer(Fig3ProbeMixin, GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._init_probe()

    class ProbedLoptiGRPOTrainer(Fig3ProbeMixin, LoptiGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._init_probe()

    return ProbedGRPOTrainer, ProbedLoptiGRPOTrainer


def _optimizer_step_counter():
    from transformers import TrainerCallback

    class OptimizerStepCounter(TrainerCallback):
        """Counts optimizer steps as the Trainer reports them (`on_optimizer_step`)."""

        def __init__(self):
            self.steps = 0

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.steps += 1

    return OptimizerStepCounter()


# ---------------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------------
def parameter_distance(model, model_path: str) -> float:
    """`||theta - theta_0||_2` over the parameters saved in `model_path` (the starting weights)."""
    import torch
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {model_path}")
    current = dict(model.named_parameters())
    total, matched = 0.0, 0
    for path in files:
        for name, initial in load_file(str(path)).items():
            if name in current:
                total += float(((current[name].detach().float().cpu() - initial.float()) ** 2).sum())
                matched += 1
    if matched == 0:
        raise RuntimeError(f"no parameter of the model matches the weights saved in {model_path}")
    return math.sqrt(total)


def train_one(args: CompareArguments, method: Method, seed: int, model_path: str, held_out, train_problems,
              before: dict[str, Any], work_dir: str) -> dict[str, Any]:  # fmt: skip
    """
    Trains one method on one seed and measures it.

    Args:
        args ([`CompareArguments`]):
            Settings.
        method ([`Method`]):
            The method.
        seed (`int`):
            The seed.
        model_path (`str`):
            The starting model folder.
        held_out (`list`):
            Held-out problems.
        train_problems (`dict`):
            Training problems per family.
        before (`dict`):
            The held-out evaluation of the starting model for this seed.
        work_dir (`str`):
            Trainer output folder (nothing is saved there).

    Returns:
        `dict`: The run's result (see the module docstring).
    """
    import torch
    from transformers import AutoTokenizer, set_seed
    from trl import GRPOConfig

    from trl_lopti import LoptiGRPOConfig

    ProbedGRPOTrainer, ProbedLoptiGRPOTrainer = make_probed_trainer_classes()
    batch_size = args.prompts_per_batch * args.num_generations
    set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = build_train_dataset(train_problems, args.rollout_batches * args.prompts_per_batch, seed)

    training_rewards: list[float] = []
    reward_fn = REWARDS[args.reward]

    def arithmetic_reward(completions, answer, **kwargs):
        rewards = reward_fn(completions, answer=answer)
        training_rewards.append(sum(rewards) / len(rewards))
        return rewards

    common = dict(
        output_dir=work_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=seed,
        data_seed=seed,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=args.weight_decay,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if method.plain_trl:
        config, trainer_class = GRPOConfig(**common), ProbedGRPOTrainer
    else:
        config = LoptiGRPOConfig(
            **common,
            advantage_reweighting_alpha=method.advantage_reweighting_alpha,
            lopti_threshold=method.lopti_threshold,
        )
        trainer_class = ProbedLoptiGRPOTrainer
    # Equal generation batches: Lopti trains each batch once per pass (TRL's GRPOConfig has one pass).
    config.max_steps = args.rollout_batches * getattr(config, "lopti_num_passes", 1)
    step_counter = _optimizer_step_counter()
    trainer = trainer_class(
        model=model_path,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[step_counter],
    )
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    trainer.finish_probe()
    train_wall, train_cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = evaluate_held_out(trainer.model, tokenizer, held_out, reward_fn, args.max_completion_length,
                              args.temperature, args.eval_samples, seed=10_000 + seed)  # fmt: skip
    result = {
        "method": method.name,
        "trainer": type(trainer).__mro__[2].__name__,
        "advantage_reweighting_alpha": method.advantage_reweighting_alpha,
        "lopti_threshold": method.lopti_threshold,
        "seed": seed,
        "settings": args.run_settings(),
        "before": before,
        "after": after,
        "training_reward": training_rewards,
        "generation_batches": trainer.generation_batches,
        "optimizer_steps": step_counter.steps,
        "global_step": trainer.state.global_step,
        "fig3_batches": trainer.probe_batches,
        "fig3": fig3_from_batches(trainer.probe_batches),
        "parameter_distance": parameter_distance(trainer.model, model_path),
        "train_wall_s": train_wall,
        "train_cpu_s": train_cpu,
        "probe_wall_s": trainer.probe_seconds,
        "torch_threads": torch.get_num_threads(),
    }
    del trainer
    gc.collect()
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------------
def t_interval(values: Sequence[float], confidence: float = 0.95) -> dict[str, Any]:
    """
    Mean and Student-t confidence interval of the mean.

    Args:
        values (`Sequence[float]`):
            One value per seed (`None` values are dropped).
        confidence (`float`, *optional*, defaults to `0.95`):
            Two-sided confidence level.

    Returns:
        `dict`: `mean`, `low`, `high`, `sd`, `n` (`low`/`high` are `None` with fewer than 2 values).
    """
    values = [float(v) for v in values if v is not None and not math.isnan(v)]
    n = len(values)
    if n == 0:
        return {"mean": None, "low": None, "high": None, "sd": None, "n": 0}
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "sd": None, "n": 1}
    from scipy import stats

    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "sd": sd, "n": n}


def fig3_from_batches(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """
    Sums the Fig.-3 counts of generation batches and turns them into shares.

    Args:
        batches (`Sequence[dict]`):
            Per-batch counts from [`shift_counts`].

    Returns:
        `dict`: per sign, per quartile (lists of 4) and `all`: `count`, `in_direction`, `share` (`in_direction /
        count`, `None` where `count` is 0), `mean_delta_prob`.
    """
    summary: dict[str, Any] = {}
    for sign in SIGNS:
        count = [sum(b[sign]["count"][q] for b in batches) for q in range(4)]
        hits = [sum(b[sign]["in_direction"][q] for b in batches) for q in range(4)]
        delta = [sum(b[sign]["sum_delta_prob"][q] for b in batches) for q in range(4)]
        summary[sign] = {
            "count": count,
            "in_direction": hits,
            "share": [h / c if c else None for h, c in zip(hits, count)],
            "mean_delta_prob": [d / c if c else None for d, c in zip(delta, count)],
            "all": {
                "count": sum(count),
                "in_direction": sum(hits),
                "share": sum(hits) / sum(count) if sum(count) else None,
            },
        }
    return summary


def aggregate(runs: Sequence[dict[str, Any]], methods: Sequence[str], baseline: str = "grpo") -> dict[str, Any]:
    """
    Per method: means and 95% t intervals over seeds, pooled Fig.-3 counts, timings, and differences to the
    baseline paired by seed (`paired_vs_<baseline>`: method minus baseline on the same seed, over the seeds both ran).

    Args:
        runs (`Sequence[dict]`):
            Finished runs.
        methods (`Sequence[str]`):
            Method order.
        baseline (`str`, *optional*, defaults to `"grpo"`):
            The method the paired differences are taken against.

    Returns:
        `dict`: method name -> summary.
    """
    summary = {}
    for name in methods:
        group = sorted((r for r in runs if r["method"] == name), key=lambda r: r["seed"])
        if not group:
            continue
        entry: dict[str, Any] = {"seeds": [r["seed"] for r in group], "num_runs": len(group)}
        for metric in ("accuracy", "reward"):
            entry[f"heldout_{metric}_before"] = t_interval([r["before"][metric] for r in group])
            entry[f"heldout_{metric}_after"] = t_interval([r["after"][metric] for r in group])
            entry[f"heldout_{metric}_change"] = t_interval([r["after"][metric] - r["before"][metric] for r in group])
        families = list(group[0]["after"]["per_family"])
        entry["heldout_per_family_after"] = {
            family: {metric: t_interval([r["after"]["per_family"][family][metric] for r in group])
                     for metric in ("accuracy", "reward")}  # fmt: skip
            for family in families
        }
        num_batches = min(len(r["training_reward"]) for r in group)
        entry["training_reward_curve"] = [
            t_interval([r["training_reward"][i] for r in group]) for i in range(num_batches)
        ]
        last = max(1, num_batches // 4)
        entry["training_reward_last_quarter"] = t_interval(
            [sum(r["training_reward"][-last:]) / last for r in group]
        )
        entry["fig3_pooled"] = fig3_from_batches([b for r in group for b in r["fig3_batches"]])
        entry["fig3_per_seed"] = {}
        for sign in SIGNS:
            entry["fig3_per_seed"][sign] = {
                "share": [t_interval([r["fig3"][sign]["share"][q] for r in group]) for q in range(4)],
                "all": t_interval([r["fig3"][sign]["all"]["share"] for r in group]),
            }
        for key in ("generation_batches", "optimizer_steps"):
            entry[key] = sorted({r[key] for r in group})
        for key in ("train_wall_s", "train_cpu_s", "probe_wall_s", "parameter_distance"):
            entry[key] = t_interval([r[key] for r in group])
        summary[name] = entry
    if baseline in summary:
        base_runs = {r["seed"]: r for r in runs if r["method"] == baseline}
        for name in summary:
            group = [r for r in runs if r["method"] == name and r["seed"] in base_runs]
            summary[name][f"paired_vs_{baseline}"] = {
                metric: t_interval([_difference(extract(r), extract(base_runs[r["seed"]])) for r in group])
                for metric, extract in PAIRED_METRICS.items()
            }
    return summary


def _difference(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or baseline is None else value - baseline


PAIRED_METRICS = {
    "heldout_accuracy_after": lambda run: run["after"]["accuracy"],
    "heldout_reward_after": lambda run: run["after"]["reward"],
    "training_reward_mean": lambda run: sum(run["training_reward"]) / len(run["training_reward"]),
    "fig3_positive_share": lambda run: run["fig3"]["positive"]["all"]["share"],
    "fig3_negative_share": lambda run: run["fig3"]["negative"]["all"]["share"],
}
PAIRED_METRICS.update({
    f"fig3_{sign}_share_q{quartile + 1}": (
        lambda run, sign=sign, quartile=quartile: run["fig3"][sign]["share"][quartile]
    )
    for sign in SIGNS for quartile in range(4)
})  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------
def _ci(stat: dict[str, Any], digits: int = 3) -> str:
    if stat is None or stat.get("mean") is None:
        return "n/a"
    if stat.get("low") is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} [{stat['low']:.{digits}f}, {stat['high']:.{digits}f}]"


def format_markdown(report: dict[str, Any]) -> str:
    """The tables of `compare_methods.md`."""
    summary, settings = report["methods"], report["settings"]
    n = len(report["seeds"])
    lines = [
        "# GRPO vs AR vs Lopti vs AR + Lopti at equal rollouts",
        "",
        f"Model: {report['model']}. Task: `{settings['task']}` ({report['task_description']}). "
        f"{settings['rollout_batches']} generation batches of {settings['prompts_per_batch']} prompts x "
        f"{settings['num_generations']} completions ({settings['max_completion_length']} tokens max) per run, "
        f"temperature {settings['temperature']:g}, constant lr {settings['learning_rate']:g}, seeds "
        f"{report['seeds']}. Figures: mean over seeds [95% t interval, n = {n}].",
        "",
        f"Command: `{report['command']}`",
        "",
        "## Held-out problems "
        f"({report['num_heldout']} problems, greedy accuracy; sampled reward: {settings['eval_samples']} samples each)",
        "",
        "| method | opt. steps / gen. batches | greedy acc. before | greedy acc. after | change | "
        "sampled reward before | sampled reward after | change | train reward, last quarter |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {'/'.join(map(str, s['optimizer_steps']))} / {'/'.join(map(str, s['generation_batches']))} "
            f"| {_ci(s['heldout_accuracy_before'])} | {_ci(s['heldout_accuracy_after'])} "
            f"| {_ci(s['heldout_accuracy_change'])} | {_ci(s['heldout_reward_before'])} "
            f"| {_ci(s['heldout_reward_after'])} | {_ci(s['heldout_reward_change'])} "
            f"| {_ci(s['training_reward_last_quarter'])} |"
        )
    if summary and "paired_vs_grpo" in next(iter(summary.values())):
        lines += ["", "Difference to `grpo` on the same seed (method minus grpo; mean [95% t interval] over seeds):",
                  "",
                  "| method | greedy acc. after | sampled reward after | mean training reward | Fig. 3, A > 0 rose | "
                  "Fig. 3, A < 0 fell |", "|---|---|---|---|---|---|"]  # fmt: skip
        for name, s in summary.items():
            if name == "grpo":
                continue
            paired = s["paired_vs_grpo"]
            lines.append(f"| {name} | " + " | ".join(_ci(paired[m]) for m in list(PAIRED_METRICS)[:5]) + " |")
    families = list(next(iter(summary.values()))["heldout_per_family_after"]) if summary else []
    if len(families) > 1:
        lines += ["", "Held-out after training, per family (greedy accuracy / sampled reward):", "",
                  "| method | " + " | ".join(families) + " |", "|---|" + "---|" * len(families)]  # fmt: skip
        for name, s in summary.items():
            cells = [f"{_ci(s['heldout_per_family_after'][f]['accuracy'], 2)} / "
                     f"{_ci(s['heldout_per_family_after'][f]['reward'], 2)}" for f in families]  # fmt: skip
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Fig.-3 statistic, every generation batch of every run",
        "",
        "Share of positive-advantage tokens whose probability rose, and of negative-advantage tokens whose probability "
        "fell, after the last optimizer step trained on their batch (Lopti: after both passes), by `pi_old` quartile "
        "of the batch (Q1 = lowest). Cells: pooled share (in-direction / tokens), then the mean of the per-seed "
        "shares [95% t interval].",
        "",
        "| method | sign | Q1 | Q2 | Q3 | Q4 | all |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        for sign in SIGNS:
            pooled, per_seed = s["fig3_pooled"][sign], s["fig3_per_seed"][sign]
            cells = []
            for q in range(4):
                share = pooled["share"][q]
                cells.append(
                    f"{share:.3f} ({pooled['in_direction'][q]}/{pooled['count'][q]}); {_ci(per_seed['share'][q])}"
                    if share is not None else "n/a"
                )  # fmt: skip
            total = pooled["all"]
            cells.append(
                f"{total['share']:.3f} ({total['in_direction']}/{total['count']}); {_ci(per_seed['all'])}"
                if total["share"] is not None else "n/a"
            )  # fmt: skip
            lines.append(f"| {name} | {sign} | " + " | ".join(cells) + " |")
    if summary and "paired_vs_grpo" in next(iter(summary.values())):
        lines += ["", "Fig.-3 shares minus grpo's on the same seed, per quartile (mean [95% t interval] over seeds):",
                  "",
                  "| method | sign | Q1 | Q2 | Q3 | Q4 |", "|---|---|---|---|---|---|"]  # fmt: skip
        for name, s in summary.items():
            if name == "grpo":
                continue
            for sign in SIGNS:
                cells = [_ci(s["paired_vs_grpo"][f"fig3_{sign}_share_q{q + 1}"]) for q in range(4)]
                lines.append(f"| {name} | {sign} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Cost and movement",
        "",
        "| method | train wall (s) | train CPU (s) | of which probe wall (s) | `‖θ_end − θ_0‖` |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {_ci(s['train_wall_s'], 0)} | {_ci(s['train_cpu_s'], 0)} | {_ci(s['probe_wall_s'], 0)} "
            f"| {_ci(s['parameter_distance'], 4)} |"
        )
    lines += ["", f"Machine: {report['machine']}. Sum of the {len(report['runs'])} runs' wall times (training, "
              f"evaluation after, loading): {report['runs_wall_s_sum'] / 60:.1f} min; wall time of the last command: "
              f"{report['total_wall_s'] / 60:.1f} min (runs reused from an earlier invocation not counted).",
              ""]  # fmt: skip
    return "\n".join(lines)


def plot_report(report: dict[str, Any], output_dir: Path) -> list[str]:
    """Learning curves with bands, Fig.-3 shares with intervals, held-out before/after. Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["methods"]
    colors = dict(zip(METHODS, ["tab:gray", "tab:blue", "tab:orange", "tab:green"]))
    paths = []

    fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.2))
    grpo_runs = {r["seed"]: r for r in report["runs"] if r["method"] == "grpo"}
    for name, s in summary.items():
        curve = s["training_reward_curve"]
        xs = list(range(1, len(curve) + 1))
        ax.plot(xs, [c["mean"] for c in curve], label=f"{name} (n={s['num_runs']})", color=colors.get(name))
        if all(c["low"] is not None for c in curve):
            ax.fill_between(xs, [max(0.0, c["low"]) for c in curve], [min(1.0, c["high"]) for c in curve],
                            alpha=0.15, color=colors.get(name))  # fmt: skip
        if name == "grpo" or not grpo_runs:
            continue
        # Same seed => same prompts in the same order: the per-batch difference to grpo is paired.
        pairs = [(r, grpo_runs[r["seed"]]) for r in report["runs"] if r["method"] == name and r["seed"] in grpo_runs]
        if not pairs:
            continue
        length = min(min(len(r["training_reward"]), len(g["training_reward"])) for r, g in pairs)
        diffs = [t_interval([r["training_reward"][i] - g["training_reward"][i] for r, g in pairs])
                 for i in range(length)]  # fmt: skip
        xs = list(range(1, length + 1))
        ax_diff.plot(xs, [d["mean"] for d in diffs], label=f"{name} - grpo (n={len(pairs)})", color=colors.get(name))
        if all(d["low"] is not None for d in diffs):
            ax_diff.fill_between(xs, [max(-1.0, d["low"]) for d in diffs], [min(1.0, d["high"]) for d in diffs],
                                 alpha=0.15, color=colors.get(name))  # fmt: skip
    ax.set_xlabel("generation batch (equal rollouts for every method)")
    ax.set_ylabel("training reward (batch mean)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Training reward: mean over seeds, 95% t band (clipped to [0, 1])", fontsize=10)
    ax.legend(fontsize=8)
    ax_diff.axhline(0.0, color="black", linewidth=0.5)
    ax_diff.set_xlabel("generation batch (same prompts per seed for every method)")
    ax_diff.set_ylabel("training reward minus grpo's, same seed")
    ax_diff.set_ylim(-1.02, 1.02)
    ax_diff.set_title("Paired difference to GRPO: mean, 95% t band", fontsize=10)
    ax_diff.legend(fontsize=8)
    fig.tight_layout()
    path = output_dir / "compare_methods_curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(str(path))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    width = 0.8 / max(1, len(summary))
    titles = ("A > 0: share whose probability rose", "A < 0: share whose probability fell")
    for ax, sign, title in zip(axes, SIGNS, titles):
        for k, (name, s) in enumerate(summary.items()):
            stats = s["fig3_per_seed"][sign]["share"]
            xs = [q + (k - (len(summary) - 1) / 2) * width for q in range(4)]
            means = [st["mean"] if st["mean"] is not None else float("nan") for st in stats]
            errors = [[(st["mean"] - st["low"]) if st["low"] is not None else 0 for st in stats],
                      [(st["high"] - st["mean"]) if st["high"] is not None else 0 for st in stats]]  # fmt: skip
            ax.bar(xs, means, width=width, yerr=errors, capsize=2, label=name, color=colors.get(name))
        ax.set_xticks(range(4), ["Q1 (lowest pi_old)", "Q2", "Q3", "Q4 (highest)"])
        ax.axhline(0.5, color="black", linewidth=0.5, linestyle=":")
        ax.set_title(title)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("share of tokens (mean over seeds, 95% t)")
    axes[1].legend(fontsize=8)
    fig.suptitle("Fig.-3 statistic over every generation batch")
    fig.tight_layout()
    path = output_dir / "compare_methods_fig3.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(str(path))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in zip(axes, ("accuracy", "reward"), ("held-out greedy accuracy", "held-out sampled reward")):
        names = list(summary)
        for k, name in enumerate(names):
            s = summary[name]
            for offset, when, hatch in ((-0.2, "before", "//"), (0.2, "after", None)):
                st = s[f"heldout_{metric}_{when}"]
                err = [[st["mean"] - st["low"]], [st["high"] - st["mean"]]] if st["low"] is not None else None
                ax.bar(k + offset, st["mean"], width=0.4, yerr=err, capsize=3, color=colors.get(name), hatch=hatch,
                       alpha=0.5 if when == "before" else 1.0, label=when if k == 0 else None)  # fmt: skip
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title + " (mean, 95% t)")
        ax.set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = output_dir / "compare_methods_heldout.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(str(path))
    return paths


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------
def _machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    text = f"{platform.machine()}, {os.cpu_count()} CPUs"
    return text + (f", load average at the end {load[0]:.1f}" if load else "")


def _resolve_model(args: CompareArguments, scratch: str) -> tuple[str, str]:
    if args.model_path is not None:
        return str(Path(args.model_path).expanduser()), str(args.model_path)
    if args.size == "tiny":
        from trl_lopti.models import build_tiny_model

        return build_tiny_model(Path(scratch) / "tiny-model", seed=0), "tiny random Qwen2 (trl_lopti.models)"
    from trl_lopti.cli.demo_model import get_smollm2

    return get_smollm2(), "SmolLM2-135M-Instruct (offline, trl_lopti.models)"


def build_report(args: CompareArguments, runs: list[dict[str, Any]], command: str, model_name: str,
                 num_heldout: int, total_wall_s: float) -> dict[str, Any]:  # fmt: skip
    """The JSON report from finished runs."""
    seeds = [seed for seed in args.seeds if any(r["seed"] == seed for r in runs)]
    return {
        "command": command,
        "seeds": seeds,
        "methods_run": [name for name in args.methods if any(r["method"] == name for r in runs)],
        "method_settings": {name: dataclasses.asdict(METHODS[name]) for name in args.methods},
        "model": model_name,
        "task_description": (
            f"families {', '.join(TASKS[args.task])}, operands 0-9, prompt 'What is <expr>? {ANSWER_PREFIX}', "
            f"reward: {args.reward}"
        ),
        "settings": args.run_settings(),
        "num_heldout": num_heldout,
        "machine": _machine(),
        "total_wall_s": total_wall_s,
        "runs_wall_s_sum": sum(run.get("run_wall_s", run["train_wall_s"]) for run in runs),
        "methods": aggregate(runs, args.methods),
        "runs": runs,
    }


def write_outputs(report: dict[str, Any], output_dir: Path) -> dict[str, str]:
    """Writes the JSON, the markdown and the PNGs; returns their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / "compare_methods.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    markdown_path = output_dir / "compare_methods.md"
    markdown_path.write_text(format_markdown(report))
    pngs = plot_report(report, output_dir) if report["methods"] else []
    return {"json": str(json_path), "markdown": str(markdown_path), "pngs": pngs}


def run_comparison(args: CompareArguments, command: str) -> dict[str, Any]:
    """
    Runs every (seed, method) pair, seeds outermost (a stopped benchmark keeps whole seeds), and writes the outputs.

    Args:
        args ([`CompareArguments`]):
            Settings.
        command (`str`):
            The command line, recorded in the report.

    Returns:
        `dict`: The report, plus `paths` (the files written).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    output_dir = Path(args.output_dir)
    runs_dir = output_dir / "compare_methods_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    train_problems, held_out = split_problems(args.task, args.num_eval_per_family)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="compare-methods-") as scratch:
        model_path, model_name = _resolve_model(args, scratch)
        for seed in args.seeds:
            before = None
            for name in args.methods:
                run_path = runs_dir / f"{name.replace('+', '_')}_seed{seed}.json"
                if args.resume and run_path.is_file():
                    previous = json.loads(run_path.read_text())
                    if previous.get("settings") == args.run_settings():
                        print(f"[compare] {name} seed {seed}: reusing {run_path}", flush=True)
                        runs.append(previous)
                        before = before or previous["before"]
                        continue
                if before is None:
                    tokenizer = AutoTokenizer.from_pretrained(model_path)
                    if tokenizer.pad_token is None:
                        tokenizer.pad_token = tokenizer.eos_token
                    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
                    before = evaluate_held_out(model, tokenizer, held_out, REWARDS[args.reward],
                                               args.max_completion_length, args.temperature, args.eval_samples,
                                               seed=10_000 + seed)  # fmt: skip
                    del model
                    print(f"[compare] seed {seed} before: greedy {before['accuracy']:.3f}, "
                          f"sampled {before['reward']:.3f}", flush=True)  # fmt: skip
                run_start = time.perf_counter()
                result = train_one(args, METHODS[name], seed, model_path, held_out, train_problems, before,
                                   str(Path(scratch) / f"trainer-{name}-{seed}"))  # fmt: skip
                result["run_wall_s"] = time.perf_counter() - run_start
                run_path.write_text(json.dumps(result, indent=1) + "\n")
                runs.append(result)
                print(
                    f"[compare] {name} seed {seed}: greedy {before['accuracy']:.3f} -> "
                    f"{result['after']['accuracy']:.3f}, "
                    f"sampled {before['reward']:.3f} -> {result['after']['reward']:.3f}, "
                    f"{result['optimizer_steps']} opt steps / {result['generation_batches']} batches, "
                    f"train {result['train_wall_s']:.0f} s wall / {result['train_cpu_s']:.0f} s CPU "
                    f"({(time.perf_counter() - start) / 60:.1f} min so far)",
                    flush=True,
                )
        report = build_report(args, runs, command, model_name, len(held_out), time.perf_counter() - start)
        report["paths"] = write_outputs(report, output_dir)
    return report


def report_only(args: CompareArguments, command: str) -> dict[str, Any]:
    """Rebuilds the outputs from the run files under `<output-dir>/compare_methods_runs/` that match the settings."""
    output_dir = Path(args.output_dir)
    runs = []
    for seed in args.seeds:
        for name in args.methods:
            run_path = output_dir / "compare_methods_runs" / f"{name.replace('+', '_')}_seed{seed}.json"
            if run_path.is_file():
                run = json.loads(run_path.read_text())
                if run.get("settings") == args.run_settings():
                    runs.append(run)
    _, held_out = split_problems(args.task, args.num_eval_per_family)
    model_name = args.model_path or ("SmolLM2-135M-Instruct (offline, trl_lopti.models)" if args.size == "smollm2"
                                     else "tiny random Qwen2 (trl_lopti.models)")  # fmt: skip
    previous = output_dir / "compare_methods.json"
    total = json.loads(previous.read_text()).get("total_wall_s", 0.0) if previous.is_file() else 0.0
    report = build_report(args, runs, command, model_name, len(held_out), total)
    report["paths"] = write_outputs(report, output_dir)
    return report


def parse_args(argv: Sequence[str] | None = None) -> tuple[CompareArguments, bool]:
    """Parses the command line into [`CompareArguments`] (the size's defaults fill what is not given)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = CompareArguments()
    parser.add_argument("--size", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--task", choices=sorted(TASKS), default=None)
    parser.add_argument("--reward", choices=sorted(REWARDS), default=None)
    parser.add_argument("--methods", nargs="+", default=None, help=f"subset of {list(METHODS)}, in run order")
    parser.add_argument("--seeds", nargs="+", type=int, default=None)
    for name in ("rollout_batches", "prompts_per_batch", "num_generations", "max_completion_length",
                 "num_eval_per_family", "eval_samples", "threads"):  # fmt: skip
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    for name in ("learning_rate", "weight_decay", "temperature"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=None)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--output-dir", default=defaults.output_dir)
    parser.add_argument("--no-resume", action="store_true", help="redo runs even if their result file exists")
    parser.add_argument("--report-only", action="store_true", help="rebuild the outputs from finished run files")
    namespace = parser.parse_args(argv)
    values: dict[str, Any] = dict(TINY_DEFAULTS) if namespace.size == "tiny" else {}
    for key, value in vars(namespace).items():
        if key in ("no_resume", "report_only"):
            continue
        if value is not None:
            values[key] = value
    values["resume"] = not namespace.no_resume
    return CompareArguments(**values), namespace.report_only


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, only_report = parse_args(argv)
    # The command that produces the runs (a `--report-only` rebuild records the run command, not itself).
    command = "python benchmarks/compare_methods.py " + shlex.join([a for a in argv if a != "--report-only"])
    report = report_only(args, command) if only_report else run_comparison(args, command)
    print(Path(report["paths"]["markdown"]).read_text())
    return report


if __name__ == "__main__":
    main()
