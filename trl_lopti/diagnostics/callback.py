"""`TokenDiagnosticsCallback`: the token diagnostics of a buffered micro-batch, logged during training."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from .batch import DiagnosticsSettings
from .probe import measure_token_gradients


def flatten_report(report: dict[str, Any], prefix: str = "diagnostics/") -> dict[str, float]:
    """
    Flattens the `gradients` part of a report (or a report from `measure_token_gradients`) into scalar metrics.

    Args:
        report (`dict[str, Any]`):
            Output of `measure_token_gradients` or `run_token_diagnostics`.
        prefix (`str`, *optional*, defaults to `"diagnostics/"`):
            Prefix of every key.

    Returns:
        `dict[str, float]`: Keys such as `diagnostics/abs_w_mean_q1`,
        `diagnostics/lowest_over_highest/summed_grad_norm`,
        `diagnostics/quartile_edge_1`; `None` values are left out.
    """
    gradients = report.get("gradients", report)
    flat: dict[str, float] = {}
    for j, row in enumerate(gradients.get("quartiles", []), start=1):
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"{prefix}{key}_q{j}"] = float(value)
    for j, edge in enumerate(gradients.get("quartile_edges", []), start=1):
        if edge is not None:
            flat[f"{prefix}quartile_edge_{j}"] = float(edge)
    for key, value in gradients.get("lowest_over_highest", {}).items():
        if value is not None:
            flat[f"{prefix}lowest_over_highest/{key}"] = float(value)
    if gradients.get("full_grad_norm") is not None:
        flat[f"{prefix}full_grad_norm"] = float(gradients["full_grad_norm"])
    return flat


class TokenDiagnosticsCallback(TrainerCallback):
    """
    Logs per-probability-quartile token diagnostics under `diagnostics/` every `every_n_steps` optimizer steps.

    At the end of every `every_n_steps`-th optimizer step, it takes one buffered micro-batch of the trainer
    (`trainer._buffered_inputs[micro_batch_index]`, the completions of the current generation batch with their
    advantages and, when TRL computed them, old and reference log-probabilities) and runs `measure_token_gradients`
    on it with the trainer's temperature, beta, clipping and loss type. Values are added to the trainer's metrics, so
    they are averaged and logged at the next logging step next to TRL's own (W&B, TensorBoard, trackio, ...). Keys:
    `diagnostics/<metric>_q<j>` (j = 1 lowest ... 4 highest), `diagnostics/quartile_edge_<j>`,
    `diagnostics/lowest_over_highest/<metric>`.

    Cost per measured step (no cost on the other steps): one no-grad forward of the policy over the micro-batch
    (`per_device_train_batch_size` completions), i.e. about a third of that micro-batch's training forward+backward,
    plus a `(tokens x vocab) @ (vocab x hidden)` product for the closed-form hidden-state gradients (the size of the
    LM head's forward); plus one no-grad forward of `ref_model` if one is passed and the batch lacks reference
    log-probabilities. With `summed_gradients=True` add one forward with grad and four backward passes (about two
    training micro-steps) and `4 x num_trainable_params` float32 of memory. The measurement runs in eval mode under
    the current parameters (after the step's update), so the ratio `pi / pi_old` can differ from one. A trainer whose
    loss the diagnostics do not model (see [`DiagnosticsSettings.from_trainer`]) is refused when the callback is made.

    Args:
        trainer (`trl.GRPOTrainer`):
            The trainer to measure (a `LoptiGRPOTrainer` works the same way).
        every_n_steps (`int`, *optional*, defaults to `50`):
            Measure every this many optimizer steps.
        summed_gradients (`bool`, *optional*, defaults to `False`):
            Also compute the per-quartile summed parameter gradients (expensive, see above).
        micro_batch_index (`int`, *optional*, defaults to `0`):
            Which buffered micro-batch to measure.
        micro_batch_size (`int`, *optional*, defaults to `4`):
            Completions per forward pass of the measurement.
        ref_model (`torch.nn.Module` or `None`, *optional*):
            Reference model, when the batch has no `ref_per_token_logps` (TRL adds them whenever `beta > 0`).
    """

    def __init__(
        self,
        trainer: Any,
        every_n_steps: int = 50,
        summed_gradients: bool = False,
        micro_batch_index: int = 0,
        micro_batch_size: int = 4,
        ref_model: torch.nn.Module | None = None,
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        DiagnosticsSettings.from_trainer(trainer)  # refuses, now, a loss the measurements do not model
        self.trainer = trainer
        self.every_n_steps = every_n_steps
        self.summed_gradients = summed_gradients
        self.micro_batch_index = micro_batch_index
        self.micro_batch_size = micro_batch_size
        self.ref_model = ref_model
        self.last_report: dict[str, Any] | None = None

    def measure(self) -> dict[str, float]:
        """
        Measures the current buffered micro-batch now and returns the flat metrics (also stored in `last_report`).

        Returns:
            `dict[str, float]`: The metrics, keys prefixed with `diagnostics/`; empty when nothing is buffered.
        """
        trainer = self.trainer
        buffered = getattr(trainer, "_buffered_inputs", None)
        if not buffered:
            return {}
        inputs = buffered[min(self.micro_batch_index, len(buffered) - 1)]
        model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        settings = DiagnosticsSettings.from_trainer(trainer, micro_batch_size=self.micro_batch_size)
        report = measure_token_gradients(
            model, inputs, self.ref_model, settings, summed_gradients=self.summed_gradients
        )
        self.last_report = report
        return flatten_report(report)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_n_steps != 0:
            return control
        metrics = self.measure()
        if not metrics:
            return control
        store = getattr(self.trainer, "_metrics", None)
        if isinstance(store, dict) and "train" in store:
            for key, value in metrics.items():
                store["train"][key].append(value)
        else:
            self.trainer.log(metrics)
        return control
