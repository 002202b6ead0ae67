"""Cost of Advantage Reweighting (AR) and Lopti against TRL's plain `GRPOTrainer`, side by side, in one process.

One command trains, on the same model, prompts and seed, one after the other:

- `grpo`: TRL's `GRPOTrainer` (the baseline every ratio is taken against);
- `ar`: `LoptiGRPOTrainer` with AR only (`advantage_reweighting_alpha=0.2`, `lopti_threshold=None`);
- `lopti`: Lopti only (`advantage_reweighting_alpha=0.0`);
- `ar+lopti`: both (`advantage_reweighting_alpha=0.3`, the paper's setting with Lopti);
- `lopti-refstyle`: Lopti plus the separate no-grad forward for old log-probabilities that the reference
  implementation always runs (emulated by computing `old_per_token_logps` after generation, which makes the same
  updates up to float rounding). It shows what `LoptiGRPOTrainer` saves by capturing `pi_old` from its first pass.
- `lopti-quantile`: Lopti with the quantile split (`lopti_quantile=0.5`, `lopti_threshold=None`): TRL computes
  `pi_old` of the whole generation batch at generation, one no-grad forward (`policy_forwards_no_grad`, its time
  within `scoring_s`) beside the fixed-eta `lopti`.

and writes `bench_<size>.json` (every measurement, per generation batch) and `bench_<size>.md` (a table with ratios
to `grpo`).

What a "step" is: Lopti runs two optimizer updates per generation batch where GRPO runs one, so steps are compared per
generation batch (rollout batch): one step = generating and scoring one batch of completions plus every forward,
backward and optimizer step trained on it. Each variant trains the same number of generation batches on the same
prompts (`max_steps` of the Lopti variants is doubled). Completions have a fixed length (`min_new_tokens`), so every
variant generates and trains on exactly the same number of tokens. The first `warmup_batches` are left out of the
medians.

Measured per generation batch (counted by hooks, not inferred from the configuration):

- time, on two clocks (wall-clock, and CPU time of the process, which on a CPU shared with other processes measures
  the work rather than the share of the CPU obtained): `generation` (`GRPOTrainer._generate`), `scoring` (the rest of
  `_generate_and_score_completions`: rewards, advantages and any no-grad old/reference log-probability forward),
  `loss+backward+optimizer` (the rest of every `training_step`, plus gradient clipping, optimizer, scheduler and
  `zero_grad`), `own_code` (the time in `LoptiGRPOTrainer`'s added work, see `OWN_CODE`) and `step` (from the end of
  the previous generation batch's last optimizer step to the end of this one's);
- passes: policy forwards with gradient, policy forwards without gradient outside generation, reference-model
  forwards, `generate` calls (whose internal decoding forwards are counted apart, as `generation_forwards`), backward
  passes that reach the model (a post-accumulate-grad hook on the input embedding) and optimizer steps;
- memory: peak RSS of the process on CPU (sampled every 10 ms, also reported above the RSS before the trainer was
  built), `torch.cuda.max_memory_allocated` on GPU;
- throughput: completion tokens per second of step time.

Sizes (`--size`): `tiny` (a random tiny Qwen2, under a minute on CPU; used by `tests/test_benchmark.py`),
`smollm2-cpu` (SmolLM2-135M-Instruct, offline, see `trl_lopti.models`; 128-token completions),
`smollm2-cpu-short` (the same with 48-token completions), `gpu` (a randomly initialised Qwen2.5-1.5B-shaped model
built from a `Qwen2Config`, bf16 autocast, plain `transformers` generation; see `benchmarks/run_gpu.sh`).

Usage:

    python benchmarks/bench_lopti.py --size smollm2-cpu --output-dir benchmarks/results
    python benchmarks/bench_lopti.py --merge run1/bench_smollm2-cpu.json run2/bench_smollm2-cpu.json  # pool runs
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import logging
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

import psutil  # noqa: E402
import torch  # noqa: E402


logger = logging.getLogger("bench_lopti")

BASELINE = "grpo"
"""The variant every ratio is taken against."""


# ---------------------------------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class Variant:
    """
    One trainer configuration of the benchmark.

    Args:
        name (`str`):
            Short name used in the report.
        description (`str`):
            One line for the markdown table.
        advantage_reweighting_alpha (`float` or `None`):
            AR strength; `None` for TRL's plain `GRPOTrainer`.
        lopti (`bool`):
            Whether Lopti is on (threshold from the size).
        reference_style (`bool`, *optional*, defaults to `False`):
            Whether to add a no-grad forward for old log-probabilities after generation, as the reference
            implementation does.
        lopti_quantile (`float` or `None`, *optional*, defaults to `None`):
            Lopti's quantile split rule (eta at this quantile of each generation batch's pi_old) in place of the
            size's fixed eta; TRL then computes pi_old at generation (a no-grad forward, counted in
            `policy_forwards_no_grad` and timed within `scoring_s`).
    """

    name: str
    description: str
    advantage_reweighting_alpha: float | None
    lopti: bool
    reference_style: bool = False
    lopti_quantile: float | None = None

    @property
    def is_grpo(self) -> bool:
        return self.advantage_reweighting_alpha is None


VARIANTS: dict[str, Variant] = {
    variant.name: variant
    for variant in (
        Variant("grpo", "TRL GRPOTrainer", None, False),
        Variant("ar", "LoptiGRPOTrainer, AR only (alpha=0.2)", 0.2, False),
        Variant("lopti", "LoptiGRPOTrainer, Lopti only", 0.0, True),
        Variant("ar+lopti", "LoptiGRPOTrainer, AR (alpha=0.3) + Lopti", 0.3, True),
        Variant(
            "lopti-refstyle",
            "Lopti + separate old-log-prob forward (reference-style)",
            0.0,
            True,
            reference_style=True,
        ),
        Variant("lopti-quantile", "Lopti, eta at the 0.5 quantile of each batch", 0.0, True, lopti_quantile=0.5),
    )
}


@dataclass(frozen=True)
class BenchmarkSize:
    """
    Model, batch shapes and device of one benchmark size.

    Args:
        name (`str`):
            Name of the size (`--size`).
        model (`str`):
            `"random-qwen2"` (a random `Qwen2Config` model written to a temporary folder, with the tiny offline
            tokenizer of `trl_lopti.models`) or `"smollm2"` (`trl_lopti.models.get_smollm2()`).
        prompts_per_batch (`int`):
            Distinct prompts per generation batch.
        num_generations (`int`):
            Completions per prompt.
        per_device_train_batch_size (`int`):
            Micro-batch of one forward/backward.
        gradient_accumulation_steps (`int`):
            Micro-batches per optimizer step; also TRL's `steps_per_generation`, so that one generation batch is one
            GRPO optimizer step and training is on-policy (TRL computes no old log-probabilities).
        max_completion_length (`int`):
            Length of every completion (also forced as `min_new_tokens`).
        warmup_batches (`int`):
            Generation batches run first and left out of the medians.
        measured_batches (`int`):
            Generation batches the medians are taken over.
        device (`str`):
            `"cpu"` or `"cuda"`.
        bf16 (`bool`):
            TRL's `bf16` (autocast) flag.
        gradient_checkpointing (`bool`):
            TRL's `gradient_checkpointing` (TRL defaults to `True`).
        lopti_threshold (`float` or `None`):
            Lopti's eta. `None` means `1 / vocab_size`: a random model's distribution is close to uniform, so that
            threshold splits its tokens into two non-empty groups and both Lopti passes run.
        model_config (`dict`):
            `Qwen2Config` fields of a `"random-qwen2"` model.
        threads (`int` or `None`):
            `torch.set_num_threads` on CPU.
        time_budget_s (`float` or `None`):
            Variants not started before this many seconds (since the start of the run) are skipped and marked so.
        warmup_run (`bool`):
            Whether to train one untimed generation batch with `GRPOTrainer` before the variants (one-time costs of
            the process: lazy imports, first kernels, allocator growth), in place of per-variant warm-up batches.
    """

    name: str
    model: str
    prompts_per_batch: int
    num_generations: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    max_completion_length: int
    warmup_batches: int
    measured_batches: int
    device: str = "cpu"
    bf16: bool = False
    gradient_checkpointing: bool = True
    lopti_threshold: float | None = 0.5
    model_config: dict[str, Any] = field(default_factory=dict)
    threads: int | None = 2
    time_budget_s: float | None = None
    warmup_run: bool = False

    @property
    def num_batches(self) -> int:
        return self.warmup_batches + self.measured_batches

    @property
    def completions_per_batch(self) -> int:
        return self.prompts_per_batch * self.num_generations


_SMOLLM2_CPU = BenchmarkSize(
    name="smollm2-cpu",
    model="smollm2",
    prompts_per_batch=2,
    num_generations=4,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_completion_length=128,
    warmup_batches=1,  # the first optimizer step of each trainer also allocates Adam's state
    measured_batches=2,
    gradient_checkpointing=False,  # a 135M model has no memory pressure on CPU
    lopti_threshold=0.5,
    # One thread: on a CPU shared with other processes, several threads stall at every barrier; process CPU time of
    # one thread measures the work itself. On a dedicated machine pass --threads with its core count.
    threads=1,
)

SIZES: dict[str, BenchmarkSize] = {
    "tiny": BenchmarkSize(
        name="tiny",
        model="random-qwen2",
        prompts_per_batch=4,
        num_generations=4,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_completion_length=12,
        warmup_batches=1,
        measured_batches=2,
        lopti_threshold=None,
        threads=1,  # overhead-bound tiny ops: one thread avoids thread-barrier stalls on a shared CPU
        # vocab larger than the tokenizer's 320 tokens, as in the `gpu` size: generated ids the tokenizer does not
        # know decode to nothing, which TRL handles.
        model_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            tie_word_embeddings=True,
        ),
    ),
    # Completions longer than prompts, as in RL, so that generation is the larger part of a GRPO step.
    "smollm2-cpu": _SMOLLM2_CPU,
    # The same with completions about as long as the prompts: loss+backward is the larger part of a GRPO step on CPU.
    "smollm2-cpu-short": dataclasses.replace(_SMOLLM2_CPU, name="smollm2-cpu-short", max_completion_length=48),
    "gpu": BenchmarkSize(
        name="gpu",
        model="random-qwen2",
        prompts_per_batch=16,
        num_generations=8,
        per_device_train_batch_size=32,
        gradient_accumulation_steps=4,
        max_completion_length=256,
        warmup_batches=1,  # also absorbs Triton's compilation of TRL's fused LM-head kernels
        measured_batches=2,
        device="cuda",
        bf16=True,
        lopti_threshold=None,
        # Qwen2.5-1.5B's shape (random weights: nothing can be downloaded on the GPU machine).
        model_config=dict(
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
        threads=None,
        time_budget_s=360.0,  # no variant starts after 6 minutes (run_gpu.sh stops everything at 7m50s)
    ),
}


# ---------------------------------------------------------------------------------------------------- task
def make_prompts(num_prompts: int, seed: int) -> list[dict[str, Any]]:
    """Two-digit additions as chat prompts, with their answers (a cheap reward with a real signal for SmolLM2)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
                "answer": str(a + b),
            }
        )
    return rows


def answer_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1 when the reference answer appears in the completion, else 0."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if ref in text else 0.0 for text, ref in zip(texts, answer, strict=True)]


def token_parity_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """Share of even token ids: varies within every group, so advantages are never all zero (random models too)."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


# ---------------------------------------------------------------------------------------------------- models
def prepare_model(size: BenchmarkSize, work_dir: Path, seed: int) -> str:
    """Returns a local model folder for `size` (built or converted offline)."""
    if size.model == "smollm2":
        from trl_lopti.cli.demo_model import get_smollm2

        return get_smollm2()
    if size.model == "random-qwen2":
        from trl_lopti.models import build_tiny_model

        return build_tiny_model(work_dir / "model", seed=seed, device=size.device, max_position_embeddings=4096,
                                **size.model_config)  # fmt: skip
    raise ValueError(f"unknown model kind {size.model!r}")


# ---------------------------------------------------------------------------------------------------- measurement
PHASES = ("generation_s", "scoring_s", "reward_s", "train_s", "backward_s", "own_code_s", "optimizer_s", "step_s")
"""Timed phases of a generation batch (`train_s`: forward, loss and backward; `optimizer_s`: clipping, optimizer,
scheduler, zero_grad; `reward_s` is part of `scoring_s`; `backward_s` and `own_code_s` are part of `train_s`)."""

OWN_CODE = ("_split", "_generation_batch_threshold", "_log_split_metrics", "_isolate_active_tokens", "_log_pass_loss")
"""`LoptiGRPOTrainer` methods that hold all of AR's and Lopti's own per-step work (timed as `own_code_s`)."""

COUNTS = (
    "policy_forwards_grad",
    "policy_forwards_no_grad",
    "policy_rows_grad",
    "policy_rows_no_grad",
    "ref_forwards",
    "generate_calls",
    "generation_forwards",
    "backward_calls",
    "backward_passes",
    "optimizer_steps",
    "prompt_tokens",
    "completion_tokens",
    "completions",
)
"""Counted quantities of a generation batch."""


@dataclass
class BatchRecord:
    """Everything measured for one generation batch: wall-clock and process CPU seconds per phase, and counts."""

    wall: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    def add_time(self, phase: str, elapsed: tuple[float, float]) -> None:
        self.wall[phase] += elapsed[0]
        self.cpu[phase] += elapsed[1]

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall": {**self.wall, "loss_backward_optimizer_s": self.wall["train_s"] + self.wall["optimizer_s"]},
            "cpu": {**self.cpu, "loss_backward_optimizer_s": self.cpu["train_s"] + self.cpu["optimizer_s"]},
            **self.counts,
        }


class _MemorySampler:
    """Samples the process RSS in a background thread (peak RSS of one variant, in the same process)."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = 0

    def __enter__(self) -> _MemorySampler:
        self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


class TrainerProbe:
    """
    Counts and times what one trainer does per generation batch, by wrapping its methods on the instance.

    A new generation batch starts at each call of `_generate_and_score_completions` in training mode. Every duration
    is taken twice: wall-clock (`time.perf_counter`) and CPU time of the process (`time.process_time`, all threads),
    which on a CPU shared with other processes measures the work done rather than the share of the CPU obtained.

    Args:
        trainer (`GRPOTrainer`):
            The trainer to observe (before `train()`).
        synchronize (`Callable[[], None]`):
            Called before every timestamp (`torch.cuda.synchronize` on GPU).
    """

    def __init__(self, trainer: Any, synchronize: Callable[[], None] = lambda: None):
        from transformers import TrainerCallback

        self.trainer = trainer
        self.synchronize = synchronize
        self.batches: list[BatchRecord] = []
        self.batch_ends: list[tuple[float, float]] = []
        self.train_begin: tuple[float, float] | None = None
        self._in_generation = False
        self._gen_score_in_step = (0.0, 0.0)
        self._last_training_step_end: tuple[float, float] | None = None
        self._handles: list[Any] = []
        probe = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                probe.train_begin = probe._now()

            def on_step_end(self, args, state, control, **kwargs):
                now = probe._now()
                record = probe._current()
                if record is not None and probe._last_training_step_end is not None:
                    record.add_time("optimizer_s", _minus(now, probe._last_training_step_end))
                    record.counts["optimizer_steps"] += 1
                    index = len(probe.batches) - 1
                    while len(probe.batch_ends) <= index:
                        probe.batch_ends.append(now)
                    probe.batch_ends[index] = now

        self.callback = _Callback()
        self._attach()

    def _now(self) -> tuple[float, float]:
        self.synchronize()
        return time.perf_counter(), time.process_time()

    def _current(self) -> BatchRecord | None:
        return self.batches[-1] if self.batches else None

    def _attach(self) -> None:
        trainer = self.trainer
        trainer.add_callback(self.callback)
        self._wrap("_generate_and_score_completions", self._around_generate_and_score)
        self._wrap("_generate", self._around_generate)
        self._wrap("_calculate_rewards", self._timed("reward_s"))
        self._wrap("training_step", self._around_training_step)
        for name in OWN_CODE:
            if hasattr(trainer, name):
                self._wrap(name, self._timed("own_code_s"))
        original_backward = trainer.accelerator.backward

        def backward(loss, **kwargs):
            start = self._now()
            try:
                return original_backward(loss, **kwargs)
            finally:
                record = self._current()
                if record is not None:
                    record.add_time("backward_s", _minus(self._now(), start))
                    record.counts["backward_calls"] += 1

        trainer.accelerator.backward = backward
        self._handles.append(trainer.model.register_forward_pre_hook(self._policy_forward_hook, with_kwargs=True))
        if getattr(trainer, "ref_model", None) is not None:
            self._handles.append(trainer.ref_model.register_forward_pre_hook(self._ref_forward_hook, with_kwargs=True))
        embedding = trainer.model.get_input_embeddings().weight
        if embedding.requires_grad:
            self._handles.append(embedding.register_post_accumulate_grad_hook(self._backward_hook))

    def _wrap(self, name: str, around: Callable[..., Any]) -> None:
        original = getattr(self.trainer, name)

        def wrapper(*args, **kwargs):
            return around(original, *args, **kwargs)

        setattr(self.trainer, name, wrapper)

    # wrappers ---------------------------------------------------------------------------------------------------
    def _around_generate_and_score(self, original, inputs, *args, **kwargs):
        training = self.trainer.model.training
        if training:
            if self.batches:
                self._log_batch(len(self.batches) - 1)
            self.batches.append(BatchRecord())
        start = self._now()
        output = original(inputs, *args, **kwargs)
        elapsed = _minus(self._now(), start)
        if training:
            record = self.batches[-1]
            # generation is timed inside; scoring is the rest
            record.add_time("scoring_s", _minus(elapsed, (record.wall["generation_s"], record.cpu["generation_s"])))
            record.counts["prompt_tokens"] += int(output["prompt_mask"].sum())
            record.counts["completion_tokens"] += int(output["completion_mask"].sum())
            record.counts["completions"] += int(output["completion_ids"].size(0))
            self._gen_score_in_step = _plus(self._gen_score_in_step, elapsed)
        return output

    def _around_generate(self, original, *args, **kwargs):
        record = self._current()
        self._in_generation = True
        start = self._now()
        try:
            return original(*args, **kwargs)
        finally:
            self._in_generation = False
            if record is not None and self.trainer.model.training:
                record.add_time("generation_s", _minus(self._now(), start))
                record.counts["generate_calls"] += 1

    def _timed(self, phase: str):
        """A wrapper that adds the time of every call (in training) to `phase` of the current generation batch."""

        def around(original, *args, **kwargs):
            start = self._now()
            try:
                return original(*args, **kwargs)
            finally:
                record = self._current()
                if record is not None and self.trainer.model.training:
                    record.add_time(phase, _minus(self._now(), start))

        return around

    def _around_training_step(self, original, *args, **kwargs):
        self._gen_score_in_step = (0.0, 0.0)
        start = self._now()
        output = original(*args, **kwargs)
        end = self._now()
        record = self._current()
        if record is not None:
            record.add_time("train_s", _minus(_minus(end, start), self._gen_score_in_step))
        self._last_training_step_end = end
        return output

    # hooks ------------------------------------------------------------------------------------------------------
    def _policy_forward_hook(self, module, args, kwargs) -> None:
        record = self._current()
        if record is None:
            return
        if self._in_generation:
            record.counts["generation_forwards"] += 1
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        rows = int(input_ids.size(0)) if isinstance(input_ids, torch.Tensor) else 0
        suffix = "grad" if torch.is_grad_enabled() else "no_grad"
        record.counts[f"policy_forwards_{suffix}"] += 1
        record.counts[f"policy_rows_{suffix}"] += rows

    def _ref_forward_hook(self, module, args, kwargs) -> None:
        record = self._current()
        if record is not None:
            record.counts["ref_forwards"] += 1

    def _backward_hook(self, parameter: torch.Tensor) -> None:
        record = self._current()
        if record is not None:
            record.counts["backward_passes"] += 1

    def _log_batch(self, index: int) -> None:
        record = self.batches[index]
        logger.info(
            "  batch %d: generation %.2fs, scoring %.2fs, loss+backward+optimizer %.2fs (wall)",
            index,
            record.wall["generation_s"],
            record.wall["scoring_s"],
            record.wall["train_s"] + record.wall["optimizer_s"],
        )

    def finalize(self) -> list[BatchRecord]:
        """Removes the hooks and fills in the whole time of each generation batch (`step_s`)."""
        for handle in self._handles:
            handle.remove()
        if self.batches:
            self._log_batch(len(self.batches) - 1)
        previous = self.train_begin
        for index, record in enumerate(self.batches):
            if index < len(self.batch_ends) and previous is not None:
                record.wall["step_s"], record.cpu["step_s"] = _minus(self.batch_ends[index], previous)
                previous = self.batch_ends[index]
        return self.batches


def _minus(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return a[0] - b[0], a[1] - b[1]


def _plus(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return a[0] + b[0], a[1] + b[1]


# ---------------------------------------------------------------------------------------------------- one variant
def _release_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with contextlib.suppress(OSError, AttributeError):  # return freed heap to the OS (glibc), for a fair RSS baseline
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reference_style_trainer_class():
    """`LoptiGRPOTrainer` that also runs the reference implementation's separate no-grad old-log-prob forward."""
    from trl_lopti import LoptiGRPOTrainer

    class ReferenceStyleLoptiGRPOTrainer(LoptiGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self.model.training and output.get("old_per_token_logps") is None:
                completion_ids = output["completion_ids"]
                with torch.no_grad():
                    output["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        self.model,
                        torch.cat([output["prompt_ids"], completion_ids], dim=1),
                        torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
                        completion_ids.size(1),
                        batch_size=self.args.per_device_train_batch_size,
                    )
            return output

    return ReferenceStyleLoptiGRPOTrainer


def _training_arguments(
    size: BenchmarkSize, variant: Variant, output_dir: str, seed: int, lopti_threshold: float
) -> dict[str, Any]:
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=size.per_device_train_batch_size,
        gradient_accumulation_steps=size.gradient_accumulation_steps,
        num_generations=size.num_generations,
        max_completion_length=size.max_completion_length,
        generation_kwargs={"min_new_tokens": size.max_completion_length},
        learning_rate=1e-6,
        temperature=1.0,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=size.device == "cpu",
        bf16=size.bf16,
        gradient_checkpointing=size.gradient_checkpointing,
        seed=seed,
        **(
            {}
            if variant.is_grpo
            else dict(
                advantage_reweighting_alpha=variant.advantage_reweighting_alpha,
                lopti_threshold=lopti_threshold if variant.lopti and variant.lopti_quantile is None else None,
                lopti_quantile=variant.lopti_quantile,
            )
        ),
    )


def run_variant(
    variant: Variant,
    size: BenchmarkSize,
    model_path: str,
    dataset: Any,
    work_dir: Path,
    seed: int,
    lopti_threshold: float,
) -> dict[str, Any]:
    """
    Trains one variant for `size.num_batches` generation batches and returns its measurements.

    Args:
        variant (`Variant`):
            Which trainer and settings.
        size (`BenchmarkSize`):
            Shapes, device and number of batches.
        model_path (`str`):
            Local model folder (every variant loads the same weights).
        dataset (`datasets.Dataset`):
            The prompts (every variant sees the same ones, in the same order).
        work_dir (`Path`):
            Scratch folder for the trainer's `output_dir`.
        seed (`int`):
            Seed of the trainer and of `torch.manual_seed`.
        lopti_threshold (`float`):
            Lopti's eta for this size.

    Returns:
        `dict`: Per-batch records, medians, counts and memory.
    """
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer

    if variant.is_grpo:
        config_class, trainer_class = GRPOConfig, GRPOTrainer
    else:
        config_class = LoptiGRPOConfig
        trainer_class = _reference_style_trainer_class() if variant.reference_style else LoptiGRPOTrainer
    synchronize = torch.cuda.synchronize if size.device == "cuda" else (lambda: None)

    _release_memory(size.device)
    baseline_rss = psutil.Process().memory_info().rss
    with _MemorySampler() as sampler:
        torch.manual_seed(seed)
        args = config_class(
            **_training_arguments(size, variant, str(work_dir / f"out-{variant.name}"), seed, lopti_threshold)
        )
        # One optimizer step per pass over a generation batch (steps_per_generation == gradient_accumulation_steps).
        passes_per_batch = getattr(args, "lopti_num_passes", 1)
        args.max_steps = size.num_batches * passes_per_batch
        trainer = trainer_class(
            model=model_path,
            reward_funcs=[answer_reward, token_parity_reward],
            args=args,
            train_dataset=dataset,
        )
        trainer.remove_callback(PrinterCallback)
        probe = TrainerProbe(trainer, synchronize)
        torch.manual_seed(seed)
        start = time.perf_counter()
        trainer.train()
        synchronize()
        train_wall_s = time.perf_counter() - start
    records = probe.finalize()
    cuda_peak = torch.cuda.max_memory_allocated() if size.device == "cuda" else None
    log_history = list(trainer.state.log_history)
    global_step = trainer.state.global_step
    del trainer, probe
    _release_memory(size.device)

    def mean_logged(key: str) -> float | None:
        values = [entry[key] for entry in log_history if entry.get(key) is not None]
        return sum(values) / len(values) if values else None

    if len(records) != size.num_batches:
        raise RuntimeError(f"{variant.name}: expected {size.num_batches} generation batches, got {len(records)}")
    batches = [record.as_dict() | {"warmup": i < size.warmup_batches} for i, record in enumerate(records)]
    return {
        "name": variant.name,
        "description": variant.description,
        "trainer": trainer_class.__name__,
        "advantage_reweighting_alpha": variant.advantage_reweighting_alpha,
        "lopti_threshold": lopti_threshold if variant.lopti and variant.lopti_quantile is None else None,
        "lopti_quantile": variant.lopti_quantile,
        "reference_style": variant.reference_style,
        "global_step": global_step,
        "train_wall_s": train_wall_s,
        "passes_per_batch": passes_per_batch,
        **summarize(batches, passes_per_batch),
        "memory": {
            "peak_rss_mb": sampler.peak / 2**20,
            "peak_rss_above_baseline_mb": (sampler.peak - baseline_rss) / 2**20,
            "baseline_rss_mb": baseline_rss / 2**20,
            "cuda_max_memory_allocated_mb": None if cuda_peak is None else cuda_peak / 2**20,
        },
        "logged": {
            "lopti/low_token_share": mean_logged("lopti/low_token_share"),
            "lopti/ar_weight_mean": mean_logged("lopti/ar_weight_mean"),
            "completions/mean_length": mean_logged("completions/mean_length"),
            "reward": mean_logged("reward"),
        },
        "batches": batches,
    }


# ---------------------------------------------------------------------------------------------------- report
def summarize(batches: list[dict[str, Any]], passes_per_batch: int) -> dict[str, Any]:
    """
    Medians of the measured (non-warm-up) generation batches of one variant.

    Args:
        batches (`list[dict]`):
            Per-batch records (`BatchRecord.as_dict()` plus `"warmup"`).
        passes_per_batch (`int`):
            Optimizer updates per generation batch (1 for GRPO and AR, 2 for Lopti).

    Returns:
        `dict`: `median` (wall-clock), `median_cpu` (process CPU time) and `counts_per_batch`.
    """
    measured = [batch for batch in batches if not batch["warmup"]]
    completion_tokens = statistics.median(batch["completion_tokens"] for batch in measured)

    def medians(clock: str) -> dict[str, float | None]:
        values = {key: statistics.median(batch[clock][key] for batch in measured) for key in measured[0][clock]}
        values["step_per_optimizer_step_s"] = values["step_s"] / passes_per_batch
        values["completion_tokens_per_s"] = completion_tokens / values["step_s"] if values["step_s"] > 0 else None
        return values

    return {
        "measured_batches": len(measured),
        "median": medians("wall"),
        "median_cpu": medians("cpu"),
        # Counted per measured generation batch; identical across batches unless a Lopti pass was skipped.
        "counts_per_batch": {key: statistics.median(batch[key] for batch in measured) for key in COUNTS},
    }


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """
    Pools the measured batches of several runs of the same size (e.g. repeated on a noisy machine) into one report.

    Medians are recomputed over all pooled batches; peak memory is the largest of the runs.

    Args:
        reports (`list[dict]`):
            Reports of [`run_benchmark`] (their JSON), of one size and the same variants.

    Returns:
        `dict`: A report of the same structure, with `merged_from` listing the runs.
    """
    if len({report["size"]["name"] for report in reports}) != 1:
        raise ValueError("can only merge runs of one size")
    merged = json.loads(json.dumps(reports[0]))
    merged["merged_from"] = [
        {"command": r.get("command"), "load_average_at_start": r["environment"].get("load_average_at_start"),
         "load_average_at_end": r.get("load_average_at_end"), "total_wall_s": r.get("total_wall_s")}
        for r in reports
    ]
    starts = [r["environment"].get("load_average_at_start") for r in reports]
    ends = [r.get("load_average_at_end") for r in reports]
    merged["environment"]["load_average_at_start"] = max((x for x in starts if x), default=None)
    merged["load_average_at_end"] = max((x for x in ends if x), default=None)
    for result in merged["results"]:
        runs = [next(r for r in report["results"] if r["name"] == result["name"]) for report in reports]
        result["batches"] = [batch for run in runs for batch in run["batches"]]
        # reports written before `passes_per_batch` was recorded: one optimizer step per pass and batch
        passes_per_batch = result.get("passes_per_batch") or int(result["batches"][0]["optimizer_steps"])
        result.update(summarize(result["batches"], passes_per_batch))
        for key in ("peak_rss_mb", "peak_rss_above_baseline_mb", "cuda_max_memory_allocated_mb"):
            values = [run["memory"][key] for run in runs if run["memory"][key] is not None]
            result["memory"][key] = max(values) if values else None
        shares = [run["logged"]["lopti/low_token_share"] for run in runs if run["logged"]["lopti/low_token_share"]]
        result["logged"]["lopti/low_token_share"] = statistics.mean(shares) if shares else None
    add_ratios(merged["results"])
    shares = [r["logged"]["lopti/low_token_share"] for r in merged["results"]]
    shares = [s for s in shares if s is not None]
    merged["low_token_share"] = statistics.median(shares) if shares else None
    return merged


def peak_memory_mb(result: dict[str, Any]) -> float:
    """The memory figure compared across variants: CUDA peak on GPU, peak RSS on CPU."""
    memory = result["memory"]
    if memory["cuda_max_memory_allocated_mb"] is not None:
        return memory["cuda_max_memory_allocated_mb"]
    return memory["peak_rss_mb"]


TIME_RATIO_KEYS = ("step_s", "generation_s", "scoring_s", "loss_backward_optimizer_s", "completion_tokens_per_s")


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Adds `ratios` and `ratios_cpu` (to the `grpo` variant) to every result, in place."""
    baseline = next((r for r in results if r["name"] == BASELINE), None)
    if baseline is None:
        return

    def ratio(value: float | None, base: float | None) -> float | None:
        return value / base if value is not None and base else None

    for result in results:
        for clock, median_key in (("ratios", "median"), ("ratios_cpu", "median_cpu")):
            result[clock] = {key: ratio(result[median_key][key], baseline[median_key][key]) for key in TIME_RATIO_KEYS}
        ratios = result["ratios"]
        ratios["peak_memory"] = ratio(peak_memory_mb(result), peak_memory_mb(baseline))
        ratios["peak_rss_above_baseline"] = ratio(
            result["memory"]["peak_rss_above_baseline_mb"], baseline["memory"]["peak_rss_above_baseline_mb"]
        )
        for key in ("policy_forwards_grad", "policy_forwards_no_grad", "backward_passes", "optimizer_steps"):
            ratios[key] = ratio(result["counts_per_batch"][key], baseline["counts_per_batch"][key])


def _table(results: list[dict[str, Any]], clock: str, memory_label: str) -> list[str]:
    median_key, ratio_key = ("median", "ratios") if clock == "wall" else ("median_cpu", "ratios_cpu")
    lines = [
        "| configuration | step (s) | generation (s) | scoring (s) | loss+bwd+opt (s) | AR/Lopti own code (s) "
        f"| fwd grad / no-grad | bwd | opt steps | {memory_label} | compl. tok/s |",
        "|" + "---|" * 11,
    ]

    def cell(result: dict[str, Any], key: str, digits: int = 2, ratios: str = ratio_key) -> str:
        value = result[median_key][key]
        text = "n/a" if value is None else f"{value:.{digits}f}"
        ratio = result.get(ratios, {}).get(key)
        return text if ratio is None or result["name"] == BASELINE else f"{text} ({ratio:.2f}x)"

    for result in results:
        counts = result["counts_per_batch"]
        memory = f"{peak_memory_mb(result):.0f}"
        if result["name"] != BASELINE and result.get("ratios", {}).get("peak_memory") is not None:
            memory += f" ({result['ratios']['peak_memory']:.2f}x)"
        lines.append(
            f"| {result['name']}: {result['description']} | {cell(result, 'step_s')} | {cell(result, 'generation_s')} "
            f"| {result[median_key]['scoring_s']:.3f} | {cell(result, 'loss_backward_optimizer_s')} "
            f"| {result[median_key]['own_code_s']:.3f} "
            f"| {counts['policy_forwards_grad']:g} / {counts['policy_forwards_no_grad']:g} "
            f"| {counts['backward_passes']:g} | {counts['optimizer_steps']:g} | {memory} "
            f"| {cell(result, 'completion_tokens_per_s', 1)} |"
        )
    return lines


def markdown_table(report: dict[str, Any]) -> str:
    """
    The markdown of a report: a table of wall-clock medians (ratios to `grpo` in parentheses) and, on CPU, the same
    table in process CPU time, then the conditions of the run.

    Args:
        report (`dict`):
            A report from [`run_benchmark`] (or its JSON file).

    Returns:
        `str`: Markdown.
    """
    results = report["results"]
    size = report["size"]
    on_gpu = size["device"] == "cuda"
    memory_label = "peak CUDA mem (MB)" if on_gpu else "peak RSS (MB)"
    lines = ["Wall-clock time per generation batch (median):", "", *_table(results, "wall", memory_label)]
    if not on_gpu:
        lines += [
            "",
            "Process CPU time per generation batch (median; all threads; robust to other processes sharing the CPU):",
            "",
            *_table(results, "cpu", memory_label),
        ]
    notes = (
        f"\nSize `{size['name']}`: model `{report['model']}`, {size['prompts_per_batch']} prompts x "
        f"{size['num_generations']} completions of {size['max_completion_length']} tokens per generation batch, "
        f"micro-batch {size['per_device_train_batch_size']} x {size['gradient_accumulation_steps']} accumulation "
        f"steps (on-policy), device {report['environment']['device']}, "
        f"{'bf16 autocast' if size['bf16'] else 'float32'}, gradient checkpointing "
        f"{'on' if size['gradient_checkpointing'] else 'off'}, torch threads {report['environment']['torch_threads']}. "
        f"Medians over {results[0]['measured_batches'] if results else 0} generation batches"
        + (f" pooled from {len(report['merged_from'])} runs" if report.get("merged_from") else "")
        + f" after {size['warmup_batches']} warm-up batch(es)"
        + (" and one untimed GRPO warm-up run" if size["warmup_run"] else "")
        + " per run; "
        "a step is one generation batch (generation, scoring and every optimizer step trained on it); passes are "
        "counted per generation batch (policy forwards outside generation, backward passes reaching the model). "
        f"Lopti threshold {report['lopti_threshold']:.4g}"
        + (f", low-token share {report['low_token_share']:.2f}" if report.get("low_token_share") is not None else "")
        + "."
    )
    load = report["environment"].get("load_average_at_start"), report.get("load_average_at_end")
    if not on_gpu and None not in load:
        notes += (
            f" 1-minute load average {load[0][0]:.1f} at the start and {load[1][0]:.1f} at the end on "
            f"{report['environment']['cpu_count']} CPUs (other processes share them: wall-clock timings are noisy)."
        )
    if report.get("skipped"):
        notes += " Skipped: " + ", ".join(f"{s['name']} ({s['reason']})" for s in report["skipped"]) + "."
    return "\n".join(lines) + "\n" + notes + "\n"


def _model_description(size: BenchmarkSize) -> str:
    if size.model == "smollm2":
        return "SmolLM2-135M-Instruct"
    config = size.model_config
    return (
        f"random Qwen2 (hidden {config.get('hidden_size')}, {config.get('num_hidden_layers')} layers, "
        f"vocab {config.get('vocab_size')})"
    )


def _environment(size: BenchmarkSize) -> dict[str, Any]:
    import transformers
    import trl

    device = platform.processor() or platform.machine()
    if size.device == "cuda":
        device = torch.cuda.get_device_name(0)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "device": f"{size.device} ({device})",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": load,
    }


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_benchmark(
    size: BenchmarkSize | str,
    output_dir: str | os.PathLike,
    variants: list[str] | None = None,
    seed: int = 42,
    command: str | None = None,
) -> dict[str, Any]:
    """
    Runs every variant on `size` in this process and writes `bench_<size>.json` and `bench_<size>.md`.

    Args:
        size (`BenchmarkSize` or `str`):
            A size or the name of one in `SIZES`.
        output_dir (`str` or `os.PathLike`):
            Where the JSON and markdown files go (created if missing).
        variants (`list[str]`, *optional*):
            Names from `VARIANTS`, in run order; defaults to all of them. `grpo` is needed for ratios.
        seed (`int`, *optional*, defaults to `42`):
            Seed of the model initialisation, the prompts, the trainers and generation.
        command (`str`, *optional*):
            The command line, recorded in the report.

    Returns:
        `dict`: The report written to the JSON file.
    """
    size = SIZES[size] if isinstance(size, str) else size
    variants = list(VARIANTS) if variants is None else variants
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if size.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"size {size.name!r} needs CUDA")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / f"bench_{size.name}.json"
    markdown_path = output_dir / f"bench_{size.name}.md"
    run_start = time.perf_counter()

    from datasets import Dataset
    from transformers import AutoConfig

    with _torch_threads(size.threads), tempfile.TemporaryDirectory(prefix="bench_lopti_") as tmp:
        work_dir = Path(tmp)
        model_path = prepare_model(size, work_dir, seed)
        vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
        lopti_threshold = size.lopti_threshold if size.lopti_threshold is not None else 1.0 / vocab_size
        dataset = Dataset.from_list(make_prompts(size.prompts_per_batch * size.num_batches, seed))
        report: dict[str, Any] = {
            "benchmark": "trl_lopti cost of AR and Lopti vs GRPOTrainer",
            "command": command,
            "size": dataclasses.asdict(size),
            "model": _model_description(size),
            "lopti_threshold": lopti_threshold,
            "seed": seed,
            "environment": _environment(size),
            "definitions": {
                "step": "one generation batch: generation, scoring and every forward/backward/optimizer step trained "
                "on it (Lopti: two optimizer updates per generation batch, GRPO one)",
                "generation_s": "time in GRPOTrainer._generate",
                "scoring_s": "rest of _generate_and_score_completions (rewards, advantages, no-grad log-prob forwards)",
                "loss_backward_optimizer_s": "training_step outside generation/scoring, plus clipping, optimizer, "
                "scheduler and zero_grad",
                "policy_forwards_grad": "calls of the policy outside generation with gradient enabled",
                "policy_forwards_no_grad": "calls of the policy outside generation without gradient",
                "backward_passes": "backward passes that reach the policy's input embedding",
                "peak memory": "torch.cuda.max_memory_allocated on GPU; peak RSS of the process on CPU",
            },
            "results": [],
            "skipped": [],
        }
        if size.warmup_run:
            start = time.perf_counter()
            warmup_size = dataclasses.replace(size, warmup_batches=0, measured_batches=1)
            run_variant(VARIANTS[BASELINE], warmup_size, model_path, dataset, work_dir, seed, lopti_threshold)
            report["warmup_run_s"] = time.perf_counter() - start
        for name in variants:
            elapsed = time.perf_counter() - run_start
            if size.time_budget_s is not None and elapsed > size.time_budget_s:
                report["skipped"].append({"name": name, "reason": f"time budget {size.time_budget_s}s spent"})
                continue
            logger.info("variant %s (%.0fs elapsed)", name, elapsed)
            result = run_variant(VARIANTS[name], size, model_path, dataset, work_dir, seed, lopti_threshold)
            report["results"].append(result)
            add_ratios(report["results"])
            shares = [r["logged"]["lopti/low_token_share"] for r in report["results"]]
            shares = [s for s in shares if s is not None]
            report["low_token_share"] = statistics.median(shares) if shares else None
            report["total_wall_s"] = time.perf_counter() - run_start
            report["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
            json_path.write_text(json.dumps(report, indent=2) + "\n")  # after every variant: partial results survive
            shutil.rmtree(work_dir / f"out-{name}", ignore_errors=True)
        markdown_path.write_text(markdown_table(report))
    report["json_path"], report["markdown_path"] = str(json_path), str(markdown_path)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--output-dir", default="benchmarks/results")
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: the size's)")
    parser.add_argument("--measured-batches", type=int, default=None)
    parser.add_argument("--warmup-batches", type=int, default=None)
    parser.add_argument("--time-budget-s", type=float, default=None)
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="pool the batches of these reports (runs of one size) into bench_<size>.json/.md; runs nothing",
    )
    args = parser.parse_args(argv)
    if args.merge:
        merged = merge_reports([json.loads(Path(path).read_text()) for path in args.merge])
        output_dir = Path(args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        name = merged["size"]["name"]
        (output_dir / f"bench_{name}.json").write_text(json.dumps(merged, indent=2) + "\n")
        (output_dir / f"bench_{name}.md").write_text(markdown_table(merged))
        print(markdown_table(merged))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("transformers", "trl", "datasets", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    size = SIZES[args.size]
    overrides = {
        key: value
        for key, value in (
            ("threads", args.threads),
            ("measured_batches", args.measured_batches),
            ("warmup_batches", args.warmup_batches),
            ("time_budget_s", args.time_budget_s),
        )
        if value is not None
    }
    size = dataclasses.replace(size, **overrides)
    report = run_benchmark(
        size, args.output_dir, variants=args.variants, seed=args.seed, command=" ".join(["python", *sys.argv])
    )
    print(Path(report["markdown_path"]).read_text())
    print(f"wrote {report['json_path']} and {report['markdown_path']} in {report['total_wall_s']:.0f}s")


if __name__ == "__main__":
    main()
