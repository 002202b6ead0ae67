"""The configs: TRL's `GRPOConfig` and `RLOOConfig`, each plus the fields of Advantage Reweighting and
Lopti."""

import dataclasses
import functools
import inspect
import math
import numbers
import sys
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
from .utils import base_trainer_class, is_trl_lopti_class


LIGER_MINIMUM_TRL = Version("1.14.0")
"""Below it, `use_liger_kernel=True` computes GRPO's loss in `compute_liger_loss`, which AR and Lopti cannot
reach."""


def fields_taken_from_a_later_base(config_class: type) -> dict[str, type]:
    """
    The fields that `@dataclass` would give `config_class` from another base than the first class in its MRO
    that declares the field itself, each with that class.

    Dataclasses collects fields in reverse MRO order, each dataclass base contributing all of its fields, inherited
    ones included: in `class C(LoptiGRPOConfig, GMPOConfig)`, the `epsilon` that `LoptiGRPOConfig` inherited from
    `GRPOConfig` (0.2) comes last and would win over `GMPOConfig`'s own (0.4).

    Args:
        config_class (`type`):
            A config class, before `@dataclass` reads it.
    """
    collected = {}
    for base in reversed(config_class.__mro__[1:]):
        collected.update(getattr(base, "__dataclass_fields__", {}))
    own = inspect.get_annotations(config_class)
    taken_from_a_later_base = {}
    for name, collected_field in collected.items():
        if name in own:
            continue
        for base in config_class.__mro__[1:]:
            declared = vars(base).get("__dataclass_fields__", {}).get(name)
            if declared is not None and name in inspect.get_annotations(base):
                if declared is not collected_field:
                    taken_from_a_later_base[name] = base
                break
    return taken_from_a_later_base


class DefaultThreshold(float):
    """The default of `lopti_threshold`, 0.5, told apart from a 0.5 that a user gives (a float of its own), so that a
    `lopti_threshold` given beside `lopti_quantile` is an error whatever its value."""


DEFAULT_LOPTI_THRESHOLD = DefaultThreshold(0.5)


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
            replaces the fixed eta (`lopti_threshold` becomes `None`; any `lopti_threshold` given beside it, 0.5
            included, is an error).
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
        default=DEFAULT_LOPTI_THRESHOLD,
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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A config with several config bases: dataclasses takes each field from the last base in reverse MRO order
        # that has it, so in `class C(LoptiGRPOConfig, GMPOConfig)` the GRPOConfig fields that LoptiGRPOConfig
        # inherited would silently win over GMPOConfig's own defaults.
        taken_from_a_later_base = fields_taken_from_a_later_base(cls)
        if taken_from_a_later_base:
            names = ", ".join(sorted(taken_from_a_later_base))
            others = [base.__name__ for base in cls.__bases__ if not issubclass(base, LoptiArguments)]
            spelling = f"@dataclass class {cls.__name__}(LoptiArguments, {', '.join(others) or '...'})"
            raise TypeError(
                f"{cls.__name__} would take the defaults of TRL's config over those its other bases declare ({names}): "
                f"compose trl_lopti's fields alone with your config, `{spelling}` (from trl_lopti import LoptiArguments)"
            )

    def __new__(cls, *args, **kwargs):
        # Without @dataclass, a class of several config bases would be built by the __init__ of one of them and
        # lose the fields of the others.
        config_bases = [base for base in cls.__bases__ if dataclasses.is_dataclass(base)]
        if len(config_bases) > 1 and "__dataclass_fields__" not in vars(cls):
            names = ", ".join(base.__name__ for base in cls.__bases__)
            raise TypeError(
                f"{cls.__name__} composes several configs ({names}) without @dataclass: write `@dataclass class "
                f"{cls.__name__}({names})`"
            )
        return super().__new__(cls)

    def __post_init__(self):
        _check_fraction(self, "advantage_reweighting_alpha", closed=True, allows_none=False, meaning="0 disables AR")
        _check_fraction(
            self, "lopti_quantile", closed=False, allows_none=True, meaning="None splits at lopti_threshold"
        )
        if self.lopti_quantile is not None:
            # Its default gives way; a value given beside the quantile, even 0.5, does not.
            threshold_given = self.lopti_threshold is not DEFAULT_LOPTI_THRESHOLD
            if self.lopti_threshold is not None and threshold_given:
                raise ValueError(
                    f"lopti_threshold={self.lopti_threshold!r} and lopti_quantile={self.lopti_quantile:g} are two "
                    "Lopti split rules (a fixed eta, or eta at a quantile of each generation batch): set only one, "
                    "lopti_threshold=None beside lopti_quantile"
                )
            # The quantile replaces the fixed eta.
            self.lopti_threshold = None
        _check_fraction(self, "lopti_threshold", closed=False, allows_none=True, meaning="None disables Lopti")
        if self.lopti_order not in LOPTI_PASS_ORDERS:
            raise ValueError(f"lopti_order must be one of {sorted(LOPTI_PASS_ORDERS)}, got {self.lopti_order!r}")
        # TRL's: derives steps_per_generation, which the schedule check needs.
        super().__post_init__()
        # Ends on a step.
        if self.lopti_enabled and self.lopti_pass_micro_steps % self.gradient_accumulation_steps:
            rule = "lopti_threshold" if self.lopti_quantile is None else "lopti_quantile"
            raise ValueError(lopti_schedule_error(self, f"set {rule}=None to train without Lopti"))
        warn_if_max_steps_ends_inside_a_cycle(self)

    def __reduce_ex__(self, protocol):
        # A class composed by `lopti_config_class` exists once composed: unpickling composes it again.
        if type(self) in COMPOSED_CONFIGS:
            return (composed_config, (COMPOSED_CONFIGS[type(self)],), dict(vars(self)))
        return super().__reduce_ex__(protocol)

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
    exactly TRL's `GRPOTrainer`. Under Lopti a generation batch spans both passes' optimizer steps, so TRL
    computes pi_old at generation: one no-grad forward per generation batch where GRPO on-policy has none.

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


def trl_config_of(lopti_config: type) -> type:
    """TRL's config (`GRPOConfig`, `RLOOConfig`) that a Lopti config of `LOPTI_CONFIGS` extends."""
    return next(trl_config for trl_config, lopti in LOPTI_CONFIGS.items() if lopti is lopti_config)


@functools.cache
def lopti_config_class(config_class: type) -> type:
    """
    The Lopti config of a config class of TRL's or a user's: `config_class` itself where it is one; TRL's own
    Lopti config of `GRPOConfig` and `RLOOConfig`; else `@dataclass class Lopti<Name>(LoptiArguments,
    config_class)`, composed once and kept, every field with the default and help of `config_class`
    (`GMPOConfig`'s `epsilon` stays 0.4) and the Lopti fields added.

    Args:
        config_class (`type`):
            A subclass of TRL's `GRPOConfig` or `RLOOConfig`, or a Lopti config.
    """
    if issubclass(config_class, LoptiArguments):
        return config_class
    if config_class in LOPTI_CONFIGS:
        return LOPTI_CONFIGS[config_class]
    name = f"Lopti{config_class.__name__}"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"`{config_class.__name__}` with the fields of Advantage Reweighting and Lopti.",
    }
    composed = dataclass(type(name, (LoptiArguments, config_class), namespace))
    COMPOSED_CONFIGS[composed] = config_class
    return composed


COMPOSED_CONFIGS: dict[type, type] = {}
"""Each config class composed by `lopti_config_class`, with the config class it composes again (on unpickling)."""


def composed_config(config_class: type) -> LoptiArguments:
    """An empty instance of `lopti_config_class(config_class)`, for unpickling."""
    composed = lopti_config_class(config_class)
    return composed.__new__(composed)


def family_lopti_config(trainer_class: type) -> type:
    """The Lopti config of a Lopti trainer class's family: [`LoptiGRPOConfig`] or [`LoptiRLOOConfig`]."""
    return next(
        vars(klass)["config_class"]
        for klass in trainer_class.__mro__
        if is_trl_lopti_class(klass) and "config_class" in vars(klass)
    )


def default_config_class(trainer_class: type) -> type:
    """
    The config whose defaults a Lopti trainer class trains with when given none: the `config_class` a user's class
    sets, else the config of the trainer it extends by TRL's naming (`GMPOTrainer`: `GMPOConfig` in its module),
    else TRL's config of the family.

    Args:
        trainer_class (`type`):
            A subclass of [`~trl_lopti.lopti_mixin.LoptiTrainerMixin`].
    """
    family_config = trl_config_of(family_lopti_config(trainer_class))
    for klass in trainer_class.__mro__:
        if "config_class" in vars(klass) and not is_trl_lopti_class(klass):
            return vars(klass)["config_class"]
    base = base_trainer_class(trainer_class, trainer_class.trl_trainer_class)
    named = vars(sys.modules[base.__module__]).get(base.__name__.removesuffix("Trainer") + "Config")
    if isinstance(named, type) and issubclass(named, family_config):
        return named
    return family_config


def check_config_fits(trainer_class: type, config_class: Any) -> None:
    """
    Raises a `TypeError` in one line where `config_class` does not fit `trainer_class`: it must be a config of the
    trainer's family (TRL's `GRPOConfig` or `RLOOConfig`) and a subclass of the config the trainer trains with
    ([`default_config_class`]: a `GMPOConfig` for a composition with `GMPOTrainer`), whose defaults it keeps.

    Args:
        trainer_class (`type`):
            A subclass of [`~trl_lopti.lopti_mixin.LoptiTrainerMixin`].
        config_class (`type`):
            The config class a user gave it.
    """
    name = getattr(config_class, "__name__", repr(config_class))
    family_config = trl_config_of(family_lopti_config(trainer_class))
    if not (isinstance(config_class, type) and issubclass(config_class, family_config)):
        raise TypeError(f"{name} is not a config of {family_config.__name__}'s family")
    default_config = default_config_class(trainer_class)
    # The trainer's own config (GMPOConfig for a GMPO trainer): another one trains with other defaults.
    if not issubclass(config_class, default_config):
        fitting = f"a {default_config.__name__} or a subclass of it"
        if not issubclass(default_config, LoptiArguments):
            fitting = f"a {lopti_config_spelling(default_config)}"
        raise TypeError(
            f"{name} does not fit {trainer_class.__name__}, which trains with a {default_config.__name__}: give "
            f"{fitting}"
        )


def as_lopti_config(args: Any, model: Any, trainer_class: type) -> LoptiArguments:
    """
    Returns the Lopti config to train `trainer_class` with: `args` itself where it is one; for a plain config
    (a user who only swapped the trainer class; a `GMPOConfig`; a user's config with fields of its own) the same
    class with the Lopti fields added ([`lopti_config_class`]), its values kept and the paper's defaults for the
    new fields, with a warning; for `None` the defaults of the trainer's base (`GMPOConfig`'s for a composition
    with `GMPOTrainer`), with TRL's naming of the output folder.

    Args:
        args (`GRPOConfig`, `RLOOConfig` or `None`):
            The configuration given to the trainer.
        model (`str` or `PreTrainedModel`):
            The model given to the trainer: it names the default output folder.
        trainer_class (`type`):
            The Lopti trainer class ([`LoptiGRPOTrainer`], [`LoptiRLOOTrainer`] or a user's composition).

    Returns:
        [`LoptiArguments`]: the config to train with.
    """
    lopti_config = family_lopti_config(trainer_class)
    default_config = default_config_class(trainer_class)
    family_config = trl_config_of(lopti_config)
    base = base_trainer_class(trainer_class, trainer_class.trl_trainer_class)
    # "GRPO", "GMPO": the trainer, and the folder name.
    base_name = base.__name__.removesuffix("Trainer")
    if args is None:
        model_name = model if isinstance(model, str) else get_config_model_id(model.config)
        config_class = lopti_config_class(default_config)
        return config_class(output_dir=f"{str(model_name).split('/')[-1]}-Lopti-{base_name}")
    if not isinstance(args, family_config):
        raise TypeError(
            f"args must be a {lopti_config.__name__} or a {family_config.__name__} (or a subclass), got "
            f"{type(args).__name__}"
        )
    warn_if_defaults_differ(args, default_config, trainer_class.__name__)
    if isinstance(args, LoptiArguments):
        return args
    config_class = lopti_config_class(type(args))
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    # TRL derived it from steps_per_generation; both set is an error.
    values["generation_batch_size"] = None
    upgrade = f"{trainer_class.__name__} got a plain {type(args).__name__} and turns on the paper's defaults for it"
    # The config with trl_lopti's fields that keeps this config's own.
    fitting = lopti_config_spelling(type(args))
    # Lopti's schedule is checked below, with advice for a plain config, which has no lopti_threshold to set.
    try:
        config = config_class(**values, lopti_threshold=None)
    except ValueError as error:
        raise ValueError(f"{upgrade}: {error} (in a {fitting})") from None
    config.lopti_threshold = LoptiArguments.lopti_threshold
    if config.lopti_pass_micro_steps % config.gradient_accumulation_steps:
        without = f"pass a {fitting} with lopti_threshold=None to train without Lopti"
        raise ValueError(f"{upgrade}: {lopti_schedule_error(config, without)}")
    warnings.warn(
        f"{upgrade}: Advantage Reweighting (advantage_reweighting_alpha={config.advantage_reweighting_alpha}) and "
        f"Lopti (lopti_threshold={config.lopti_threshold}, lopti_order={config.lopti_order!r}). Lopti trains each "
        f"generation batch twice, so it makes two optimizer steps where {base_name} makes one: max_steps, the "
        "learning-rate schedule, save_steps and logging_steps now count twice per generation batch, and max_steps "
        f"buys half the rollouts. Pass a {fitting} to choose these values "
        f"(lopti_threshold=None and advantage_reweighting_alpha=0 give plain {base_name}).",
        UserWarning,
        stacklevel=3,
    )
    warn_if_max_steps_ends_inside_a_cycle(config)
    return config


def lopti_config_spelling(config_class: type) -> str:
    """How a user writes the Lopti config that keeps every field of `config_class`: TRL's own configs have one in
    trl_lopti (`trl_lopti.LoptiGRPOConfig`), any other is composed with [`LoptiArguments`]."""
    if config_class in LOPTI_CONFIGS:
        return f"trl_lopti.{LOPTI_CONFIGS[config_class].__name__}"
    name = config_class.__name__
    return f"config of `@dataclass class Lopti{name}(trl_lopti.LoptiArguments, {name})`"


def warn_if_defaults_differ(args: Any, default_config: type, trainer_name: str) -> None:
    """
    Warns where `args` is not a `default_config` (the config of the trainer's base, e.g. `GMPOConfig`) and keeps
    a default of its own class where `default_config`'s differs, naming those fields.

    Args:
        args (`GRPOConfig` or `RLOOConfig`):
            The config given to the trainer.
        default_config (`type`):
            The config of the trainer's base.
        trainer_name (`str`):
            The trainer's class name, for the warning.
    """
    if isinstance(args, default_config):
        return
    defaults = {f.name: f.default for f in dataclasses.fields(default_config) if f.init}
    differ = [
        f"{f.name} ({f.default!r}, not {defaults[f.name]!r})"
        for f in dataclasses.fields(args)
        if f.name in defaults
        and f.default is not dataclasses.MISSING
        and f.default != defaults[f.name]
        and getattr(args, f.name) == f.default
    ]
    if differ:
        warnings.warn(
            f"{trainer_name} got a {type(args).__name__}, which is not a {default_config.__name__}: it trains with "
            f"the defaults of {type(args).__name__} where they differ from {default_config.__name__}'s: "
            f"{', '.join(differ)}. Pass a {lopti_config_spelling(default_config)}, or args=None",
            UserWarning,
            stacklevel=4,
        )


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
    # The default eta stays itself: a config rebuilt from this one's values (`dataclasses.replace`) keeps it a default.
    if value is not DEFAULT_LOPTI_THRESHOLD:
        setattr(config, name, float(value))
