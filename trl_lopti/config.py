"""`LoptiGRPOConfig`: TRL's `GRPOConfig` plus the fields of Advantage Reweighting, Lopti and REINFORCE++."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

import torch

from . import _compat  # noqa: F401, I001  (checks the TRL version before TRL is imported)
from trl import GRPOConfig

from .core_algos import ADVANTAGE_ESTIMATORS, LOPTI_PASS_ORDERS, lopti_batch_threshold


@dataclass
class LoptiGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`LoptiGRPOTrainer`].

    Every field of TRL's `GRPOConfig` keeps its meaning and default. The fields below add Advantage Reweighting (AR)
    and Low-Probability Token Isolation (Lopti) from "Do Not Let Low-Probability Tokens Over-Dominate in RL for
    LLMs" (arXiv 2505.12929), and the paper's second base algorithm, REINFORCE++. With
    `advantage_reweighting_alpha=0.0`, `lopti_threshold=None` (and `lopti_quantile` unset) and
    `advantage_estimator="grpo"` the trainer is exactly TRL's `GRPOTrainer`.

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
            parameters the first pass produced). Must lie in (0, 1); `None` splits at `lopti_quantile` instead, or,
            with that unset too, disables Lopti. The paper uses 0.5 and recommends [0.3, 0.5]; the authors' script for
            Lopti alone uses 0.4. What a pass costs and how it counts against `max_steps`: README, section "The Lopti
            schedule".
        lopti_quantile (`float` or `None`, *optional*, defaults to `None`):
            The other split rule of the paper's authors (their `seperate_portion`): eta of each generation batch is
            the quantile at level q of pi_old over all completion tokens of the whole batch (every process; linear
            interpolation, as `torch.quantile`), so a share q of the tokens is low however the policy's confidence
            drifts. Must lie in (0, 1); it needs `lopti_threshold=None` (the two rules are exclusive, and
            `lopti_threshold` defaults to 0.5). It costs one no-grad forward per generation batch for pi_old, taken
            before the first pass.
        lopti_order (`str`, *optional*, defaults to `"low_first"`):
            Which token group is updated first: `"low_first"` (the method) or `"high_first"` (the paper's ablation,
            which collapses training; offered for reproducing it).

        > Parameters that control the advantage estimator

        advantage_estimator (`str`, *optional*, defaults to `"grpo"`):
            `"grpo"`: TRL's group-relative advantages (every GRPO option applies). `"reinforce_plus_plus"`: the
            paper's REINFORCE++ (outcome reward, gamma 1): each completion's reward, whitened over all completion
            tokens of the whole generation batch on every process (token-weighted mean, unbiased variance), with no
            per-prompt baseline; `scale_rewards` is then not used. AR and Lopti apply on top of either.
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
    lopti_quantile: float | None = field(
        default=None,
        metadata={
            "help": "Lopti split at a quantile of the batch: eta of each generation batch is the quantile at level q "
            "in (0, 1) of pi_old over all its completion tokens (every process). Needs lopti_threshold=None. One "
            "extra no-grad forward per generation batch. None: split at lopti_threshold."
        },
    )
    lopti_order: str = field(
        default="low_first",
        metadata={
            "help": "Order of the two Lopti passes: 'low_first' (the method) or 'high_first' (the paper's ablation).",
            "choices": list(LOPTI_PASS_ORDERS),
        },
    )
    advantage_estimator: str = field(
        default="grpo",
        metadata={
            "help": "Advantage estimator: 'grpo' (TRL's group-relative advantages) or 'reinforce_plus_plus' (the "
            "reward whitened over all completion tokens of the generation batch, no group baseline).",
            "choices": list(ADVANTAGE_ESTIMATORS),
        },
    )

    def __post_init__(self):
        self.advantage_reweighting_alpha = _real_in_range(
            "advantage_reweighting_alpha", self.advantage_reweighting_alpha, "[0, 1]", lambda x: 0.0 <= x <= 1.0,
            allow_none=False, disabled_hint="0 disables AR",
        )
        self.lopti_threshold = _real_in_range(
            "lopti_threshold", self.lopti_threshold, "(0, 1)", lambda x: 0.0 < x < 1.0,
            allow_none=True, disabled_hint="None disables Lopti",
        )
        self.lopti_quantile = _real_in_range(
            "lopti_quantile", self.lopti_quantile, "(0, 1)", lambda x: 0.0 < x < 1.0,
            allow_none=True, disabled_hint="None splits at lopti_threshold",
        )
        if self.lopti_quantile is not None and self.lopti_threshold is not None:
            raise ValueError(
                f"lopti_threshold={self.lopti_threshold:g} and lopti_quantile={self.lopti_quantile:g} are two Lopti "
                "split rules (a fixed eta, or eta at a quantile of each generation batch) and only one can be used: "
                "set lopti_threshold=None to split at the quantile (lopti_threshold defaults to 0.5), or "
                "lopti_quantile=None to split at the fixed eta"
            )
        if self.lopti_order not in LOPTI_PASS_ORDERS:
            raise ValueError(f"lopti_order must be one of {sorted(LOPTI_PASS_ORDERS)}, got {self.lopti_order!r}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage_estimator must be one of {list(ADVANTAGE_ESTIMATORS)}, got {self.advantage_estimator!r}"
            )
        super().__post_init__()
        reinforce_plus_plus = self.advantage_estimator == "reinforce_plus_plus"
        if reinforce_plus_plus and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "advantage_estimator='reinforce_plus_plus' whitens the weighted sum of the rewards, so "
                "multi_objective_aggregation must be 'sum_then_normalize' (its normalisation is then not used), got "
                f"{self.multi_objective_aggregation!r}"
            )
        if self.lopti_enabled and not lopti_pass_ends_on_optimizer_step(self):
            raise ValueError(lopti_schedule_error(self))

    @property
    def lopti_enabled(self) -> bool:
        """Whether Low-Probability Token Isolation is on (with either split rule)."""
        return self.lopti_threshold is not None or self.lopti_quantile is not None

    @property
    def lopti_pass_order(self) -> tuple[str | None, ...]:
        """The token group active in each pass over a generation batch: `("low", "high")`, or `(None,)` without Lopti."""
        return LOPTI_PASS_ORDERS[self.lopti_order] if self.lopti_enabled else (None,)

    @property
    def lopti_num_passes(self) -> int:
        """How many times each generation batch is trained (optimizer schedules per batch): 2 with Lopti, else 1."""
        return len(self.lopti_pass_order)

    def lopti_batch_threshold(self, old_per_token_logps: torch.Tensor, completion_mask: torch.Tensor) -> float | None:
        """
        eta of a generation batch: `lopti_threshold`, or the `lopti_quantile` quantile of the batch's pi_old.

        Args:
            old_per_token_logps (`torch.Tensor`):
                pi_old log-probabilities of the whole generation batch (every process); read by the quantile rule only.
            completion_mask (`torch.Tensor`):
                Same shape: nonzero for the completion tokens that count.

        Returns:
            `float` or `None`: eta (the split is `pi_old < eta`); `None` when Lopti is off.
        """
        if self.lopti_quantile is not None:
            return lopti_batch_threshold(old_per_token_logps, completion_mask, self.lopti_quantile)
        return self.lopti_threshold

    @property
    def advantage_reweighting_enabled(self) -> bool:
        """Whether Advantage Reweighting is on."""
        return self.advantage_reweighting_alpha != 0.0


LOPTI_FIELD_NAMES: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(LoptiGRPOConfig) if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)}
)
"""The fields `LoptiGRPOConfig` adds to TRL's `GRPOConfig` (AR, Lopti, the advantage estimator)."""


def lopti_pass_ends_on_optimizer_step(config: GRPOConfig) -> bool:
    """Whether a Lopti pass (`steps_per_generation * num_iterations` micro-steps) ends on an optimizer step."""
    return (config.steps_per_generation * config.num_iterations) % config.gradient_accumulation_steps == 0


def lopti_schedule_error(config: GRPOConfig, upgraded_from_grpo_config: bool = False) -> str:
    """
    The message for a schedule in which a Lopti pass would not end on an optimizer step.

    Args:
        config (`GRPOConfig`):
            The configuration (its `steps_per_generation` already resolved by `GRPOConfig.__post_init__`).
        upgraded_from_grpo_config (`bool`, *optional*, defaults to `False`):
            Whether the user passed a plain `GRPOConfig` (so never set a Lopti field).

    Returns:
        `str`: What is wrong, in the fields the user has, and how to fix it.
    """
    steps, iterations, accumulation = (
        config.steps_per_generation, config.num_iterations, config.gradient_accumulation_steps
    )
    fitting = accumulation // math.gcd(accumulation, iterations)
    suggestion = steps + (-steps) % fitting  # the next steps_per_generation that fits
    global_batch = config.generation_batch_size // steps
    message = (
        f"Lopti trains each generation batch in two passes, and each pass must end on an optimizer step: "
        f"steps_per_generation * num_iterations ({steps} * {iterations} = {steps * iterations}) must be a multiple of "
        f"gradient_accumulation_steps ({accumulation}). Set steps_per_generation={suggestion} (or "
        f"generation_batch_size={suggestion * global_batch}, {global_batch} completions per micro-step over all "
        "processes)"
    )
    if upgraded_from_grpo_config:
        return (
            "LoptiGRPOTrainer got a plain GRPOConfig and turns on the paper's Lopti (lopti_threshold=0.5) for it. "
            + message
            + ", or pass trl_lopti.LoptiGRPOConfig(..., lopti_threshold=None) to train without Lopti."
        )
    return message + ", or set lopti_threshold=None and lopti_quantile=None to train without Lopti."


def _real_in_range(name, value, interval, contains, allow_none, disabled_hint):
    """Validates a real-valued field: any real number (numpy included) or its text; `None`/"none" where allowed."""
    expected = f"{name} must be a number in {interval} ({disabled_hint})"
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("none", "null"):
            if allow_none:
                return None
            raise ValueError(f"{expected}; got {value!r}")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{expected}; got the text {value!r}, which is not a number") from None
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{expected}; got None")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{expected}; got {value!r} of type {type(value).__name__}")
    value = float(value)
    if not contains(value):  # NaN fails every comparison
        raise ValueError(f"{expected}; got {value!r}")
    return value
