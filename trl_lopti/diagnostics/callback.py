"""`TokenDiagnosticsCallback`: the token diagnostics of the current generation batch, logged in training."""

from typing import Any

from transformers import TrainerCallback

from .loss import generation_batch
from .measure import run_token_diagnostics


def flatten_report(report: dict[str, Any], prefix: str = "diagnostics/") -> dict[str, float]:
    """The `gradients` part of a `run_token_diagnostics` report (or the part itself) as scalar metrics.

    The keys are such as `diagnostics/abs_w_mean_q1`, `diagnostics/quartile_edge_1`,
    `diagnostics/lowest_over_highest/summed_grad_norm` and `diagnostics/full_grad_norm` (with the default
    `prefix`); `None` values are left out."""
    gradients = report.get("gradients", report)
    figures = ((j, key, value) for j, row in enumerate(gradients["quartiles"], start=1) for key, value in row.items())
    flat = {f"{prefix}{key}_q{j}": value for j, key, value in figures if not isinstance(value, (str, bool))}
    flat.update({f"{prefix}quartile_edge_{j}": edge for j, edge in enumerate(gradients["quartile_edges"], start=1)})
    ratios = gradients["lowest_over_highest"]
    flat.update({f"{prefix}lowest_over_highest/{key}": value for key, value in ratios.items()})
    flat[f"{prefix}full_grad_norm"] = gradients.get("full_grad_norm")
    return {key: float(value) for key, value in flat.items() if value is not None}


class TokenDiagnosticsCallback(TrainerCallback):
    """
    Logs the per-quartile token diagnostics of the trainer's generation batch every few optimizer steps.

    At the end of every `every_n_steps`-th optimizer step it joins the trainer's buffered micro-batches
    (TRL's `trainer._buffered_inputs`, TRL's keys only: the generation batch being trained on, with its
    advantages and, where TRL computed them, old and reference log-probabilities) and runs
    `run_token_diagnostics` on it, without the probe, at the current parameters, under the trainer's loss.
    The figures go to `trainer._metrics["train"]` under `diagnostics/` (`flatten_report`), averaged and
    logged at the next logging step beside TRL's. pi_old is the batch's `old_per_token_logps` where every
    micro-batch has them, else the current policy's.

    Cost per measured step: two no-grad forwards of the generation batch; with `summed_gradients`, one
    forward with grad, four backward passes and `4 x num_trainable_params` float32 of memory.

    Args:
        trainer (`GRPOTrainer`):
            TRL's `GRPOTrainer` or a `LoptiGRPOTrainer`.
        every_n_steps (`int`, *optional*, defaults to `50`):
            How many optimizer steps apart the measurements are.
        summed_gradients (`bool`, *optional*, defaults to `False`):
            Whether to measure the quartiles' summed parameter gradients too.
        micro_batch_size (`int`, *optional*, defaults to `4`):
            How many completions go per forward.
    """

    def __init__(
        self, trainer: Any, every_n_steps: int = 50, summed_gradients: bool = False, micro_batch_size: int = 4
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.trainer = trainer
        self.every_n_steps = every_n_steps
        self.summed_gradients = summed_gradients
        self.micro_batch_size = micro_batch_size
        self.last_report: dict[str, Any] | None = None

    def measure(self) -> dict[str, float]:
        """Measures the current generation batch and returns the flat metrics (the report: `last_report`)."""
        batch = generation_batch(self.trainer)
        if batch is None:
            return {}
        report = run_token_diagnostics(
            self.trainer,
            batch,
            summed_gradients=self.summed_gradients,
            probe_methods=(),
            micro_batch_size=self.micro_batch_size,
        )
        self.last_report = report["gradients"]
        return flatten_report(report)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            for key, value in self.measure().items():
                self.trainer._metrics["train"][key].append(value)
        return control
