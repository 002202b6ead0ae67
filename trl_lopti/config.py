"""`LoptiGRPOConfig`: TRL's `GRPOConfig` plus the three fields of Advantage Reweighting and Lopti."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from .core_algos import LOPTI_PASS_ORDERS


@dataclass
class LoptiGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`LoptiGRPOTrainer`].

    Every field of TRL's `GRPOConfig` keeps its meaning and default. The fields below add Advantage Reweighting (AR)
    and Low-Probability Token Isolation (Lopti) from "Do Not Let Low-Probability Tokens Over-Dominate in RL for
    LLMs" (arXiv 2505.12929). With `advantage_reweighting_alpha=0.0` and `lopti_threshold=None` the trainer is
    exactly TRL's `GRPOTrainer`.

    Parameters:
        > Parameters that control Advantage Reweighting

        advantage_reweighting_alpha (`float`, *optional*, defaults to `0.3`):
            alpha in `A'(i, t) = (alpha * pi_old(i, t) + 1 - alpha) * A(i)`, where `pi_old(i, t)` is the probability
            of the sampled token under the policy that generated the batch. Must lie in [0, 1]; `0.0` disables AR.
            The paper uses 0.3 together with Lopti on Knights & Knaves, 0.2 for AR alone there, 0.1 on math.

        > Parameters that control Low-Probability Token Isolation

        lopti_threshold (`float` or `None`, *optional*, defaults to `0.5`):
            eta: completion tokens with `pi_old < eta` are "low", the others "high". Each generation batch is then
            trained twice: first with only the low tokens active, then with only the high tokens active (from the
            parameters the first pass produced). Must lie in (0, 1); `None` disables Lopti. The paper uses 0.5 and
            recommends [0.3, 0.5].
        lopti_order (`str`, *optional*, defaults to `"low_first"`):
            Which token group is updated first: `"low_first"` (the method) or `"high_first"` (the paper's ablation,
            which collapses training; offered for reproducing it).

    Lopti and the training schedule:
        Each pass is the whole schedule plain GRPO runs on a generation batch (all its micro-batches, optimizer
        steps and `num_iterations`), so a generation batch costs twice the optimizer steps. `num_train_epochs` keeps
        its meaning (passes over the prompts: GRPO and Lopti see the same rollouts per epoch), while `max_steps`,
        `save_steps`, `logging_steps` and the learning-rate schedule count optimizer steps, as in the Trainer. To
        compare GRPO and Lopti at equal rollouts with `max_steps`, give Lopti twice the `max_steps`.
    """

    advantage_reweighting_alpha: float = field(
        default=0.3,
        metadata={
            "help": "Advantage Reweighting strength alpha in [0, 1]: A'(i,t) = (alpha * pi_old(i,t) + 1 - alpha) * "
            "A(i). 0.0 disables AR."
        },
    )
    lopti_threshold: float | None = field(
        default=0.5,
        metadata={
            "help": "Lopti probability threshold eta in (0, 1): tokens with pi_old < eta are updated in a separate "
            "pass before the others. None disables Lopti."
        },
    )
    lopti_order: str = field(
        default="low_first",
        metadata={
            "help": "Order of the two Lopti passes: 'low_first' (the method) or 'high_first' (the paper's ablation).",
            "choices": list(LOPTI_PASS_ORDERS),
        },
    )

    def __post_init__(self):
        _validate_lopti_fields(self)
        super().__post_init__()
        if self.lopti_threshold is not None:
            pass_micro_steps = self.steps_per_generation * self.num_iterations
            if pass_micro_steps % self.gradient_accumulation_steps != 0:
                raise ValueError(
                    "Lopti needs every pass to end on an optimizer step: steps_per_generation * num_iterations "
                    f"({self.steps_per_generation} * {self.num_iterations} = {pass_micro_steps}) must be a multiple "
                    f"of gradient_accumulation_steps ({self.gradient_accumulation_steps}). Set steps_per_generation "
                    "to a multiple of gradient_accumulation_steps, or lopti_threshold=None."
                )

    @property
    def lopti_enabled(self) -> bool:
        """Whether Low-Probability Token Isolation is on."""
        return self.lopti_threshold is not None

    @property
    def advantage_reweighting_enabled(self) -> bool:
        """Whether Advantage Reweighting is on."""
        return self.advantage_reweighting_alpha != 0.0


def _validate_lopti_fields(config: LoptiGRPOConfig) -> None:
    alpha = config.advantage_reweighting_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"advantage_reweighting_alpha must be a number in [0, 1] (0 disables AR), got {alpha!r}")
    config.advantage_reweighting_alpha = float(alpha)

    threshold = config.lopti_threshold
    if threshold is not None:
        if isinstance(threshold, str) and threshold.strip().lower() in ("none", "null", ""):
            threshold = None
        elif isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold < 1.0:
            raise ValueError(
                f"lopti_threshold must be a number in the open interval (0, 1), or None to disable Lopti; got "
                f"{threshold!r}"
            )
    config.lopti_threshold = None if threshold is None else float(threshold)

    if config.lopti_order not in LOPTI_PASS_ORDERS:
        raise ValueError(f"lopti_order must be one of {sorted(LOPTI_PASS_ORDERS)}, got {config.lopti_order!r}")
