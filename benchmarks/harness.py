"""The benchmarks' one harness: [`measure_training`] trains one trainer configuration and measures it through a
[`Probe`], generation batch by generation batch; benchmarks/README.md ("What is measured") defines every phase and
count. The probe sees the trainer only through what TRL and transformers define (the methods TRL's `GRPOTrainer` and
`RLOOTrainer` share), never a method of `LoptiGRPOTrainer` or `LoptiRLOOTrainer`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import json
import os
import platform
import random
import re
import resource
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoConfig, PrinterCallback, TrainerCallback, set_seed
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from trl_lopti import LoptiArguments, LoptiGRPOConfig, LoptiGRPOTrainer, LoptiRLOOConfig, LoptiRLOOTrainer, lopti_mixin
from trl_lopti.diagnostics import completion_log_probs, probability_quartiles, probability_shift
from trl_lopti.lopti_mixin import describe_method
from trl_lopti.models import build_tiny_model, get_smollm2
from trl_lopti.tasks import completion_to_text
from trl_lopti.utils import trl_completion_logps


PHASES = ("generation_s", "scoring_s", "loss_backward_optimizer_s", "probe_s", "step_s", "fact_checks_s")
COUNTS = (  # policy forwards outside generation, generate calls and their decoding forwards, backward passes reaching
    # the policy (its input embedding), optimizer steps, tokens
    "policy_forwards_grad",
    "policy_forwards_no_grad",
    "generate_calls",
    "generation_forwards",
    "backward_passes",
    "optimizer_steps",
    "prompt_tokens",
    "completion_tokens",
    "completions",
)
FACT_CHECKS = [(lopti_mixin, name) for name in vars(lopti_mixin) if name.startswith("check_") or name == "prompts_of"]
"""What runs for the runtime checks of the TRL facts, timed as `fact_checks_s` (within the other phases)."""
LOGGED_PREFIXES = ("lopti/", "reward")
"""Logged metrics kept per generation batch: TRL's `reward`, `reward_std`, `rewards/*`, and the trainer's `lopti/*`."""

TRAINERS = {
    "grpo": (GRPOConfig, GRPOTrainer, LoptiGRPOConfig, LoptiGRPOTrainer),
    "rloo": (RLOOConfig, RLOOTrainer, LoptiRLOOConfig, LoptiRLOOTrainer),
}
"""The trainers a run can measure: TRL's config and trainer, and the Lopti config and trainer that extend them."""
UNAVAILABLE: dict[str, str] = {}
"""Why a base algorithm is missing from `TRAINERS` on this install (the cost experiment skips its variants)."""

try:
    with warnings.catch_warnings():
        # TRL warns on every import from trl.experimental: this one is on purpose.
        warnings.simplefilter("ignore")
        from trl.experimental.gmpo import GMPOConfig, GMPOTrainer
except ImportError:
    UNAVAILABLE["gmpo"] = f"TRL {version('trl')} has no trl.experimental.gmpo (GMPOTrainer: TRL >= 1.16.0)"
else:
    # AR and Lopti on GMPO, composed as a user writes it (docs/trainers/own.md).
    @dataclasses.dataclass
    class LoptiGMPOConfig(LoptiArguments, GMPOConfig): ...

    class LoptiGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer): ...

    TRAINERS["gmpo"] = (GMPOConfig, GMPOTrainer, LoptiGMPOConfig, LoptiGMPOTrainer)

# Every run: no checkpoints, no reporting, every optimizer step logged, no KL (no reference model; RLOO: no penalty).
BASE_ARGS = dict(
    report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, beta=0.0, dataloader_num_workers=0
)


class Probe(TrainerCallback):
    """
    Counts and times what one trainer does per generation batch. Time goes to the innermost running phase:
    `loss_backward_optimizer_s` for `training_step` (and from its end to the callback's `on_step_end`: clipping,
    optimizer, scheduler, `zero_grad`), within it `scoring_s` for `_generate_and_score_completions`, within that
    `generation_s` for `_generate`, and `probe_s` for the Fig.-3 forwards; `step_s` runs from the end of the previous
    batch's last optimizer step to the end of this one's. `fact_checks_s`, within those, is the time of `FACT_CHECKS`.

    Args:
        trainer (`GRPOTrainer` or `RLOOTrainer`):
            The trainer to observe, before `train()`.
        after_scoring (`Callable[[GRPOTrainer, dict], None]`, *optional*):
            Called with every training generation batch as `_generate_and_score_completions` returns it, within
            `scoring_s` (e.g. [`add_old_logps_forward`]).
        fig3 (`bool`, *optional*, defaults to `False`):
            Keep in `fig3_batches` the Fig.-3 statistic (`trl_lopti.diagnostics.probability_shift`, and the quartile
            `edges`) of every batch, its tokens scored after generation (`pi_old`) and after the last optimizer step
            trained on it (uncounted forwards).
        capture_token_gradients (`bool`, *optional*, defaults to `False`):
            Keep in `token_gradients` the micro-batch and the per-token log-probabilities (with `.grad`) of the first
            training forward.
    """

    def __init__(self, trainer, after_scoring=None, fig3: bool = False, capture_token_gradients: bool = False):
        self.trainer, self.after_scoring, self.fig3 = trainer, after_scoring, fig3
        self.batches: list[dict[str, Any]] = []
        self.fig3_batches: list[dict[str, Any]] = []
        self.token_gradients: tuple[dict[str, Any], torch.Tensor] | None = None
        self._cuda = trainer.accelerator.device.type == "cuda"
        self._phases: list[str] = []  # the running phases, innermost last
        self._mark = self._train_begin = None  # when time was last charged to a phase; when train() began
        self._uncounted = False
        self._pending: dict[str, Any] | None = None  # the last batch and its pi_old, until it is re-scored (Fig. 3)
        self._loss_inputs: dict[str, Any] | None = None
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(self)
        self._unpatched = [(owner, name, vars(owner)[name]) for owner, name in FACT_CHECKS]
        for owner, name, function in self._unpatched:
            setattr(owner, name, self._timed(function))
        wrappers = {
            "_generate_and_score_completions": self._around_generate_and_score,
            "_generate": self._around_generate,
            "training_step": self._around_training_step,
        }
        if capture_token_gradients:
            wrappers["compute_loss"] = self._around_compute_loss
        for name, around in wrappers.items():
            setattr(trainer, name, functools.partial(around, getattr(trainer, name)))  # on the instance only
        model = trainer.model
        self._handles = [
            model.register_forward_pre_hook(self._on_forward, with_kwargs=True),
            model.get_input_embeddings().weight.register_post_accumulate_grad_hook(self._on_backward),
        ]
        if capture_token_gradients:
            self._handles.append(model.register_forward_hook(self._keep_log_prob_gradient, with_kwargs=True))

    # clocks -------------------------------------------------------------------------------------------------------
    def _timed(self, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = self._now()
            try:
                return function(*args, **kwargs)
            finally:
                for clock, now, then in zip(("wall", "cpu"), self._now(), start, strict=True) if self.batches else ():
                    self.batches[-1][clock]["fact_checks_s"] += now - then

        return functools.wraps(function)(timed)

    def _now(self) -> tuple[float, float]:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter(), time.process_time()

    def _charge(self, phase: str | None = None) -> tuple[float, float]:
        """Adds the time since the last charge to `phase` (default: the innermost running one; none between steps) of
        the current batch, on both clocks; returns now."""
        now, phase = self._now(), phase or (self._phases[-1] if self._phases else None)
        if phase and self.batches and self._mark:
            for clock, index in (("wall", 0), ("cpu", 1)):
                self.batches[-1][clock][phase] += now[index] - self._mark[index]
        self._mark = now
        return now

    @contextlib.contextmanager
    def _phase(self, phase: str):
        self._charge()
        self._phases.append(phase)
        try:
            yield
        finally:
            self._charge()
            self._phases.pop()

    # wrappers of TRL's methods ------------------------------------------------------------------------------------
    def _around_generate_and_score(self, original, inputs):
        if not self.trainer.model.training:
            return original(inputs)
        clocks = {clock: dict.fromkeys(PHASES, 0.0) for clock in ("wall", "cpu")}
        self.batches.append({**clocks, **dict.fromkeys(COUNTS, 0), "logged": {}})
        with self._phase("probe_s"):
            self._rescore()
        with self._phase("scoring_s"):
            output = original(inputs)
            if self.after_scoring is not None:
                self.after_scoring(self.trainer, output)
        batch = self.batches[-1]
        batch["prompt_tokens"] += int(output["prompt_mask"].sum())
        batch["completion_tokens"] += int(output["completion_mask"].sum())
        batch["completions"] += int(output["completion_ids"].size(0))
        if self.fig3:
            with self._phase("probe_s"):
                keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
                self._pending = {key: output[key].detach() for key in keys}
                self._pending["logps"] = self._score(self._pending)
        return output

    def _around_generate(self, original, *args, **kwargs):
        if not self.trainer.model.training:
            return original(*args, **kwargs)
        self.batches[-1]["generate_calls"] += 1
        with self._phase("generation_s"):
            return original(*args, **kwargs)

    def _around_training_step(self, original, *args, **kwargs):
        with self._phase("loss_backward_optimizer_s"):
            return original(*args, **kwargs)

    def _around_compute_loss(self, original, model, inputs, *args, **kwargs):
        self._loss_inputs = inputs
        return original(model, inputs, *args, **kwargs)

    # hooks --------------------------------------------------------------------------------------------------------
    def _on_forward(self, module, args, kwargs) -> None:
        if not self.batches or self._uncounted:
            return
        if self._phases[-1:] == ["generation_s"]:
            self.batches[-1]["generation_forwards"] += 1
        else:
            self.batches[-1]["policy_forwards_grad" if torch.is_grad_enabled() else "policy_forwards_no_grad"] += 1

    def _keep_log_prob_gradient(self, module, args, kwargs, output) -> None:
        if self.token_gradients is None and torch.is_grad_enabled() and self._phases[-1:] != ["generation_s"]:
            output.log_probs.retain_grad()  # TRL's fused head: per-token log-probabilities of every position
            self.token_gradients = (self._loss_inputs, output.log_probs)

    def _on_backward(self, parameter: torch.Tensor) -> None:
        if self.batches:
            self.batches[-1]["backward_passes"] += 1

    # callback events ----------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._mark = self._train_begin = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        if self.batches:
            self.batches[-1]["end"] = self._charge("loss_backward_optimizer_s")
            self.batches[-1]["optimizer_steps"] += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.batches:
            for key, value in (logs or {}).items():
                if key.startswith(LOGGED_PREFIXES):
                    self.batches[-1]["logged"].setdefault(key, []).append(value)

    def on_train_end(self, args, state, control, **kwargs):
        with self._phase("probe_s"):
            self._rescore()

    # Fig. 3 -------------------------------------------------------------------------------------------------------
    def _score(self, batch: dict[str, Any]) -> torch.Tensor:
        self._uncounted = True
        try:
            return completion_log_probs(self.trainer.model, batch, self.trainer.temperature).cpu()
        finally:
            self._uncounted = False

    def _rescore(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            edges, quartile = probability_quartiles(pending["logps"], pending["completion_mask"].cpu())
            shift = probability_shift(pending["logps"], self._score(pending), pending["advantages"].cpu(), quartile)
            self.fig3_batches.append({"edges": edges, **shift})

    def finalize(self) -> list[dict[str, Any]]:
        """Removes the hooks and fills in `step_s` of every batch; returns the batches."""
        for handle in self._handles:
            handle.remove()
        for owner, name, function in self._unpatched:
            setattr(owner, name, function)
        previous = self._train_begin
        for batch in self.batches:
            end = batch.pop("end", None)
            if end is not None and previous is not None:
                batch["wall"]["step_s"], batch["cpu"]["step_s"] = end[0] - previous[0], end[1] - previous[1]
                previous = end
        return self.batches


def add_old_logps_forward(trainer, batch: dict[str, Any]) -> None:
    """
    The reference implementation's separate no-grad forward for `pi_old`, after generation (an `after_scoring` hook):
    `old_per_token_logps` by TRL's own log-prob forward, in micro-batches of `per_device_train_batch_size`, where TRL
    did not compute it already.
    """
    if batch.get("old_per_token_logps") is None:
        with torch.no_grad():
            batch_size = trainer.args.per_device_train_batch_size
            batch["old_per_token_logps"] = trl_completion_logps(trainer, batch, batch_size=batch_size)[0]


# One run -------------------------------------------------------------------------------------------------------------
def measure_training(
    model_path: str,
    dataset,
    reward_funcs,
    generation_batches: int,
    lopti: dict[str, Any] | None = None,
    *,
    algorithm: str = "grpo",
    after_scoring: Callable[[Any, dict], None] | None = None,
    fig3: bool = False,
    capture_token_gradients: bool = False,
    after_training: Callable[[Any], dict[str, Any]] | None = None,
    processing_class=None,
    **config_fields: Any,
) -> dict[str, Any]:
    """
    Trains one configuration for `generation_batches` generation batches (`max_steps` is this times `lopti_num_passes`:
    equal rollouts): TRL's trainer of `algorithm` (`"grpo"`, `"rloo"` or `"gmpo"`, `TRAINERS`) where `lopti` is
    `None`, else its Lopti trainer with those Lopti config fields; `config_fields` are fields of TRL's config on top of
    `BASE_ARGS`.
    `after_training(trainer)` runs after training (hooks removed) and its entries join the result, beside `trainer`,
    `method`, `global_step`, `train_wall_s`, `train_cpu_s`, `peak_memory_mb`, `batches` and, when asked (see
    [`Probe`]), `fig3_batches`, `token_gradients`.
    """
    cuda = not config_fields.get("use_cpu", True)
    _reset_peak_memory(cuda)
    with tempfile.TemporaryDirectory(prefix="bench-") as output_dir:
        fields = {**BASE_ARGS, "output_dir": output_dir, **config_fields}
        if algorithm in UNAVAILABLE:
            raise RuntimeError(UNAVAILABLE[algorithm])
        trl_config, trl_trainer, lopti_config, lopti_trainer = TRAINERS[algorithm]
        args = trl_config(**fields) if lopti is None else lopti_config(**fields, **lopti)
        args.max_steps = generation_batches * getattr(args, "lopti_num_passes", 1)
        set_seed(args.seed)
        trainer_class = trl_trainer if lopti is None else lopti_trainer
        # The dataset by keyword: `GMPOTrainer` takes every argument after `args` so.
        trainer = trainer_class(
            model_path, reward_funcs, args, train_dataset=dataset, processing_class=processing_class
        )
        probe = Probe(trainer, after_scoring, fig3, capture_token_gradients)
        torch.manual_seed(args.seed)
        start = probe._now()
        trainer.train()
        end = probe._now()
        result = {
            "trainer": trainer_class.__name__,
            "method": algorithm.upper() if lopti is None else describe_method(args, algorithm.upper()),
            "global_step": trainer.state.global_step,
            "train_wall_s": end[0] - start[0],
            "train_cpu_s": end[1] - start[1],
            "peak_memory_mb": _peak_memory_mb(cuda),
            "batches": probe.finalize(),
        }
        if fig3:
            result["fig3_batches"] = probe.fig3_batches
        if capture_token_gradients:
            result["token_gradients"] = probe.token_gradients
        if after_training is not None:
            result.update(after_training(trainer))
    del trainer, probe
    _reset_peak_memory(cuda)
    return result


def _reset_peak_memory(cuda: bool) -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # return freed heap to the OS (glibc): a fair RSS baseline
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak RSS (VmHWM) restarts from the current RSS


def _peak_memory_mb(cuda: bool) -> float:
    """`torch.cuda.max_memory_allocated` on GPU; else the peak RSS since the last reset (Linux; elsewhere, ever)."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    with contextlib.suppress(OSError, AttributeError):
        return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# Models, prompts, rewards, records -----------------------------------------------------------------------------------
def prepare_model(kind: str, work_dir: Path, seed: int = 0, device: str = "cpu", **model_config: Any) -> str:
    """A local model folder: `"smollm2"` (offline, `trl_lopti.models.get_smollm2`), else a random Qwen2."""
    if kind == "smollm2":
        return get_smollm2()
    return build_tiny_model(work_dir / "random-qwen2", seed=seed, device=device, **model_config)


def addition_prompts(num_prompts: int, seed: int):
    """Two-digit additions as chat prompts with their answers (a cheap reward with a real signal for SmolLM2)."""
    rng, rows = random.Random(seed), []
    for a, b in ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(num_prompts)):
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}]})
        rows[-1]["answer"] = str(a + b)
    return Dataset.from_list(rows)


def answer_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1 when the reference answer appears in the completion, else 0."""
    return [float(ref in completion_to_text(c)) for c, ref in zip(completions, answer, strict=True)]


def record(args, model_path: str, **fields: Any) -> dict[str, Any]:
    """The head of an experiment's JSON: the experiment, its command line and options (the dataclass `args`), the
    model, the conditions it ran in (versions, device, threads, 1-minute load average), then `fields`."""
    config = AutoConfig.from_pretrained(model_path)
    return {
        "experiment": type(args).__name__.lower(),
        "command": shlex.join(["python", *sys.argv]),
        "options": dataclasses.asdict(args),
        "model": f"{Path(model_path).name} ({config.model_type}, hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layers, vocab {config.vocab_size})",
        "environment": {
            "python": platform.python_version(),
            **{package: version(package) for package in ("torch", "transformers", "trl")},
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
        },
        **fields,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Writes `data` to `path` through a temporary file, so a stopped run leaves the previous complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    partial.replace(path)
