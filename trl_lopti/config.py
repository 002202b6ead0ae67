"""The configs: TRL's `GRPOConfig` and `RLOOConfig`, each plus the fields of Advantage Reweighting and
Lopti."""

import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version

# Checks the TRL version before TRL is imported.
from . import trl_contract


# isort: split
from trl import GRPOConfig, RLOOConfig
from trl.trainer.utils import get_config_model_id

from .core_algos import ADVANTAGE_ESTIMATORS, LOPTI_PASS_ORDERS


LIGER_MINIMUM_TRL = Version("1.14.0")
"""Below it, `use_liger_kernel=True` computes GRPO's loss in `compute_liger_loss`, which AR and Lopti cannot
reach."""


@dataclass
class LoptiArguments:
    r"""
    The fields of Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti), arXiv 2505.12929,
    that [`LoptiGRPOConfig`] and [`LoptiRLOOConfig`] add to TRL's configs (written once, here).

    Parameters:
        advantage_reweighting_alpha (`float`, *optional*, defaults to `0.3`):
            alpha in `A'(i, t) = (alpha * pi_old(i, t) + 1 - alpha) * A(i)`, where `pi_old(i, t)` is the
            probability of the sampled token under the policy that generated the batch. Must lie in [0, 1];
            `0.0` disables AR. RLOO's loss takes one advantage per sequence: there the gradient through each
            token's log-probability is weighted by the same factor, and the loss's value is unchanged
            (`trl_lopti.core_algos.reweight_token_gradients`). The paper uses 0.3 together with Lopti on
            Knights & Knaves, 0.2 for AR alone there, 0.1 on math.
        lopti_threshold (`float` or `None`, *optional*, defaults to `0.5`):
            eta: completion tokens with `pi_old < eta` are "low", the others "high". Each generation batch is
            then trained twice: first with only the low tokens active, then with only the high tokens active
            (from the parameters the first pass produced). Must lie in (0, 1); `None` (with `lopti_quantile`
            unset) disables Lopti. The paper uses 0.5 and recommends [0.3, 0.5]; the authors' script for
            Lopti alone uses 0.4. Each pass is the whole schedule the base trainer runs on a batch, so
            `max_steps` counts two optimizer steps per generation batch ([The Lopti
            schedule][the-lopti-schedule-and-what-max_steps-means]).
        lopti_quantile (`float` or `None`, *optional*, defaults to `None`):
            The authors' other split rule (`seperate_portion`): eta of each generation batch is the quantile
            at level q in (0, 1) of pi_old over all its completion tokens (every process; linear
            interpolation), so a share q of the tokens is low however the policy's confidence drifts. It
            replaces the fixed eta (`lopti_threshold` becomes `None`; another value than its default beside
            it is an error).
        lopti_order (`str`, *optional*, defaults to `"low_first"`):
            Which token group is updated first: `"low_first"` (the method) or `"high_first"` (the paper's
            ablation, which collapses training; offered for reproducing it).
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
            "pass before the others. None (and no lopti_quantile) disables Lopti."
        },
    )
    lopti_quantile: float | None = field(
        default=None,
        metadata={
            "help": "Lopti split at a quantile of the batch, in place of lopti_threshold: eta of each generation "
            "batch is the quantile at level q in (0, 1) of pi_old over all its completion tokens (every process)."
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
        _check_fraction(self, "advantage_reweighting_alpha", closed=True, allows_none=False, meaning="0 disables AR")
        _check_fraction(self, "lopti_threshold", closed=False, allows_none=True, meaning="None disables Lopti")
        _check_fraction(
            self, "lopti_quantile", closed=False, allows_none=True, meaning="None splits at lopti_threshold"
        )
        if self.lopti_quantile is not None:
            # Its default gives way.
            if self.lopti_threshold not in (None, LoptiArguments.lopti_threshold):
                raise ValueError(
                    f"lopti_threshold={self.lopti_threshold:g} and lopti_quantile={self.lopti_quantile:g} are two "
                    "Lopti split rules (a fixed eta, or eta at a quantile of each generation batch): set only one"
                )
            # The quantile replaces the fixed eta.
            self.lopti_threshold = None
        if self.lopti_order not in LOPTI_PASS_ORDERS:
            raise ValueError(f"lopti_order must be one of {sorted(LOPTI_PASS_ORDERS)}, got {self.lopti_order!r}")
        # TRL's: derives steps_per_generation, which the schedule check needs.
        super().__post_init__()
        # Ends on a step.
        if self.lopti_enabled and self.lopti_pass_micro_steps % self.gradient_accumulation_steps:
            rule = "lopti_threshold" if self.lopti_quantile is None else "lopti_quantile"
            raise ValueError(lopti_schedule_error(self, f"set {rule}=None to train without Lopti"))
        warn_if_max_steps_ends_inside_a_cycle(self)

    @property
    def lopti_enabled(self) -> bool:
        """Whether Low-Probability Token Isolation is on (with either split rule)."""
        return self.lopti_threshold is not None or self.lopti_quantile is not None

    @property
    def lopti_pass_order(self) -> tuple[str | None, ...]:
        """The token group active in each pass over a generation batch: `("low", "high")`; `(None,)` without
        Lopti."""
        return LOPTI_PASS_ORDERS[self.lopti_order] if self.lopti_enabled else (None,)

    @property
    def lopti_num_passes(self) -> int:
        """How many times each generation batch is trained (optimizer schedules per batch): 2 with Lopti,
        else 1."""
        return len(self.lopti_pass_order)

    @property
    def lopti_pass_micro_steps(self) -> int:
        """Micro-steps in one pass over a generation batch: the schedule the base trainer runs on it."""
        return self.steps_per_generation * self.num_iterations

    @property
    def lopti_cycle_micro_steps(self) -> int:
        """Micro-steps trained on one generation batch (one pass per token group)."""
        return self.lopti_num_passes * self.lopti_pass_micro_steps

    @property
    def advantage_reweighting_enabled(self) -> bool:
        """Whether Advantage Reweighting is on."""
        return self.advantage_reweighting_alpha != 0.0


@dataclass
class LoptiGRPOConfig(LoptiArguments, GRPOConfig):
    r"""
    Configuration class for [`LoptiGRPOTrainer`].

    Every field of TRL's `GRPOConfig` keeps its meaning and default. [`LoptiArguments`] adds Advantage
    Reweighting (`advantage_reweighting_alpha`) and Lopti (`lopti_threshold`, `lopti_quantile`,
    `lopti_order`); this class adds the paper's second base algorithm, REINFORCE++. With
    `advantage_reweighting_alpha=0.0`, `lopti_threshold=None` and `advantage_estimator="grpo"` the trainer is
    exactly TRL's `GRPOTrainer`. With `lopti_quantile`, where TRL computes no pi_old itself, eta costs one
    no-grad forward per generation batch.

    Parameters:
        advantage_estimator (`str`, *optional*, defaults to `"grpo"`):
            `"grpo"`: TRL's group-relative advantages. `"reinforce_plus_plus"`: the paper's REINFORCE++
            (outcome reward, gamma 1): each reward whitened over all completion tokens of the generation
            batch on every process, no per-prompt baseline (`scale_rewards` unused). AR and Lopti apply on
            top of either.
    """

    advantage_estimator: str = field(
        default="grpo",
        metadata={
            "help": "Advantage estimator: 'grpo' (TRL's group-relative advantages) or 'reinforce_plus_plus' (the "
            "reward whitened over all completion tokens of the generation batch, no group baseline).",
            "choices": list(ADVANTAGE_ESTIMATORS),
        },
    )

    def __post_init__(self):
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage_estimator must be one of {list(ADVANTAGE_ESTIMATORS)}, got {self.advantage_estimator!r}"
            )
        super().__post_init__()
        if self.use_liger_kernel and Version(trl_contract.TRL_VERSION) < LIGER_MINIMUM_TRL:
            raise ValueError(
                f"use_liger_kernel=True: with TRL {trl_contract.TRL_VERSION}, GRPOTrainer computes the Liger loss in "
                "compute_liger_loss, which never calls the log-prob forward that Advantage Reweighting and Lopti act "
                f"through, so they would be silently ignored. Set use_liger_kernel=False, or install TRL >= "
                f"{LIGER_MINIMUM_TRL} (where the Liger loss goes through it)"
            )
        if self.advantage_reweighting_enabled and self.importance_sampling_level == "sequence" and self.beta != 0.0:
            raise ValueError(
                f"advantage_reweighting_alpha={self.advantage_reweighting_alpha:g} with importance_sampling_level="
                f"'sequence' and beta={self.beta:g}: where a sequence's tokens share one importance ratio, AR scales the "
                "gradient through each token's log-probability, and so would reweight the KL term's gradient, which AR "
                "leaves alone. Set beta=0.0, advantage_reweighting_alpha=0.0, or importance_sampling_level='token'"
            )
        aggregation = self.multi_objective_aggregation
        if self.advantage_estimator == "reinforce_plus_plus" and aggregation != "sum_then_normalize":
            raise ValueError(
                "advantage_estimator='reinforce_plus_plus' whitens the weighted sum of the rewards, so "
                "multi_objective_aggregation must be 'sum_then_normalize' (its normalisation is then not used), got "
                f"{aggregation!r}"
            )


@dataclass
class LoptiRLOOConfig(LoptiArguments, RLOOConfig):
    r"""
    Configuration class for [`LoptiRLOOTrainer`].

    Every field of TRL's `RLOOConfig` keeps its meaning and default (`beta=0.05`: RLOO's KL is a reward
    penalty). [`LoptiArguments`] adds Advantage Reweighting and Lopti. With `advantage_reweighting_alpha=0.0`
    and `lopti_threshold=None` the trainer is exactly TRL's `RLOOTrainer`. RLOO computes pi_old at every
    generation, so neither method, nor `lopti_quantile`, costs a forward pass.
    """


LOPTI_CONFIGS: dict[type, type] = {GRPOConfig: LoptiGRPOConfig, RLOOConfig: LoptiRLOOConfig}
"""TRL's config of each trainer and its Lopti config."""


def as_lopti_config(args: Any, model: Any, config_class: type = LoptiGRPOConfig) -> LoptiArguments:
    """
    Returns the Lopti config (`config_class`, e.g. [`LoptiGRPOConfig`]) to train with: `args` itself; for a
    plain TRL config (a user who only swapped the trainer class) the same values with the paper's defaults
    for the new fields, with a warning; for `None` the defaults, with TRL's naming of the output folder.

    Args:
        args (`GRPOConfig`, `RLOOConfig` or `None`):
            The configuration given to the trainer.
        model (`str` or `PreTrainedModel`):
            The model given to the trainer: it names the default output folder.
        config_class (`type`, *optional*, defaults to [`LoptiGRPOConfig`]):
            [`LoptiGRPOConfig`] or [`LoptiRLOOConfig`].

    Returns:
        [`LoptiArguments`]: the config to train with.
    """
    base = next(trl_class for trl_class, lopti_class in LOPTI_CONFIGS.items() if lopti_class is config_class)
    # "GRPO", "RLOO": TRL's trainer, and the folder name.
    trainer = base.__name__.removesuffix("Config")
    if isinstance(args, config_class):
        return args
    if args is None:
        model_name = model if isinstance(model, str) else get_config_model_id(model.config)
        return config_class(output_dir=f"{str(model_name).split('/')[-1]}-Lopti-{trainer}")
    if not isinstance(args, base):
        raise TypeError(f"args must be a {config_class.__name__} or a {base.__name__}, got {type(args).__name__}")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(base) if f.init}
    # TRL derived it from steps_per_generation; both set is an error.
    values["generation_batch_size"] = None
    upgrade = f"Lopti{trainer}Trainer got a plain {base.__name__} and turns on the paper's defaults for it"
    # Lopti's schedule is checked below, with advice for a plain config, which has no lopti_threshold to set.
    try:
        config = config_class(**values, lopti_threshold=None)
    except ValueError as error:
        raise ValueError(f"{upgrade}: {error} (in a trl_lopti.{config_class.__name__})") from None
    config.lopti_threshold = LoptiArguments.lopti_threshold
    if config.lopti_pass_micro_steps % config.gradient_accumulation_steps:
        without = f"pass a trl_lopti.{config_class.__name__}(..., lopti_threshold=None) to train without Lopti"
        raise ValueError(f"{upgrade}: {lopti_schedule_error(config, without)}")
    warnings.warn(
        f"{upgrade}: Advantage Reweighting (advantage_reweighting_alpha={config.advantage_reweighting_alpha}) and "
        f"Lopti (lopti_threshold={config.lopti_threshold}, lopti_order={config.lopti_order!r}). Lopti trains each "
        f"generation batch twice, so it makes two optimizer steps where {trainer} makes one: max_steps, the "
        "learning-rate schedule, save_steps and logging_steps now count twice per generation batch, and max_steps "
        f"buys half the rollouts. Pass a trl_lopti.{config_class.__name__} to choose these values "
        f"(lopti_threshold=None and advantage_reweighting_alpha=0 give plain {trainer}).",
        UserWarning,
        stacklevel=3,
    )
    warn_if_max_steps_ends_inside_a_cycle(config)
    return config


def lopti_schedule_error(config: LoptiArguments, without_lopti: str) -> str:
    """The error of a schedule whose Lopti pass would not end on an optimizer step: a fix, or
    `without_lopti`."""
    steps = config.steps_per_generation
    iterations = config.num_iterations
    accumulation = config.gradient_accumulation_steps
    fitting = accumulation // math.gcd(accumulation, iterations)
    # The next steps_per_generation that fits.
    suggestion = steps + (-steps) % fitting
    global_batch = config.generation_batch_size // steps
    return (
        f"Lopti trains each generation batch in two passes, and each pass must end on an optimizer step: "
        f"steps_per_generation * num_iterations ({steps} * {iterations} = {steps * iterations}) must be a multiple of "
        f"gradient_accumulation_steps ({accumulation}). Set steps_per_generation={suggestion} (or "
        f"generation_batch_size={suggestion * global_batch}, {global_batch} completions per micro-step over all "
        f"processes), or {without_lopti}."
    )


def warn_if_max_steps_ends_inside_a_cycle(config: LoptiArguments) -> None:
    """Warns when `max_steps` ends a run between the passes of its last generation batch (which then trains
    its first pass only), naming the nearest `max_steps` that does not."""
    # Optimizer steps per batch.
    cycle_steps = config.lopti_cycle_micro_steps // config.gradient_accumulation_steps
    if config.lopti_enabled and config.max_steps > 0 and config.max_steps % cycle_steps:
        below = config.max_steps - config.max_steps % cycle_steps
        fits = " or max_steps=".join(str(steps) for steps in (below, below + cycle_steps) if steps > 0)
        warnings.warn(
            f"max_steps={config.max_steps} ends inside a generation batch's Lopti cycle ({cycle_steps} optimizer steps "
            f"per generation batch, {cycle_steps // 2} per pass): the last batch would train its "
            f"{LOPTI_PASS_ORDERS[config.lopti_order][0]} pass only. Set max_steps={fits}.",
            UserWarning,
            stacklevel=2,
        )


def _check_fraction(config: LoptiArguments, name: str, closed: bool, allows_none: bool, meaning: str) -> None:
    """
    Makes the field `name` of `config` a float if it is a real number (numpy scalars included) in its interval;
    else raises, naming the field, the interval and `meaning`.

    Args:
        config (`LoptiArguments`):
            The config being built.
        name (`str`):
            The field.
        closed (`bool`):
            Whether the interval is [0, 1]; else (0, 1).
        allows_none (`bool`):
            Whether `None` is a value of the field.
        meaning (`str`):
            What the field's special value means, for the error.
    """
    value = getattr(config, name)
    interval = "[0, 1]" if closed else "(0, 1)"
    if value is None and allows_none:
        return
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    # NaN fails both comparisons.
    if not (real and ((0.0 <= value <= 1.0) if closed else (0.0 < value < 1.0))):
        raise ValueError(f"{name} must be a number in {interval} ({meaning}), got {value!r}")
    setattr(config, name, float(value))
