"""
`trl-lopti check`: trl_lopti's contract with TRL, verified on this machine's own stack.

On a tiny random model built here (nothing is downloaded), `LoptiGRPOTrainer` and `LoptiRLOOTrainer` are
checked by relations against TRL's own trainers and losses (`CHECK_FACTS`). Every training run in them runs
the runtime checks of the TRL facts (`trl_lopti.trl_contract`), so a broken fact fails its check with the
fact's number. A check that fails for another reason (TRL's own trainer failing, out of memory) names no
fact: the verdict is then inconclusive, and not cached.
"""

import argparse
import contextlib
import dataclasses
import io
import json
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import trl_contract


# isort: split
import transformers
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM
from transformers.utils import logging

from .cli.base import CliError, import_class
from .config import check_config_fits, default_config_class, lopti_config_class
from .grpo_trainer import LoptiGRPOTrainer
from .lopti_mixin import LOPTI_BATCH_KEYS, LoptiTrainerMixin
from .models import PEAKED_TINY_MODEL, build_tiny_model
from .rloo_trainer import LoptiRLOOTrainer
from .tasks import token_parity_reward
from .trl_contract import (
    CHECKPOINTS,
    GRPO_GENERATION,
    GRPO_LOSS,
    GRPO_REWARDS,
    LOSS_FORWARD,
    LOSS_MASK,
    RLOO_GENERATION,
    RLOO_LOSS,
    SCHEDULE,
)
from .utils import defining_class, temporarily_set


TOLERANCES = {"fp64": 1e-6, "fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}
"""The relative tolerance of a relation, by precision: TRL's fused log-prob head computes in float32 under
float64 weights, and half precision rounds to its mantissa. Zeros must be exact in every precision."""

KNOWN_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
"""GRPO's loss types in TRL 1.16, tried beside those the installed `GRPOConfig`'s help names."""

TRAINERS = {"grpo": LoptiGRPOTrainer, "rloo": LoptiRLOOTrainer}

TRL_CONFIGS = {"grpo": trl.GRPOConfig, "rloo": trl.RLOOConfig}

CHECK_FACTS = {
    "grpo": {
        "off": (SCHEDULE, LOSS_FORWARD, LOSS_MASK, GRPO_GENERATION),
        "cycle": (SCHEDULE, LOSS_FORWARD, LOSS_MASK, GRPO_GENERATION, GRPO_REWARDS),
        "resume": (CHECKPOINTS,),
        "isolation": (LOSS_FORWARD, LOSS_MASK, GRPO_LOSS),
        "ar": (LOSS_FORWARD, LOSS_MASK, GRPO_LOSS),
    },
    "rloo": {
        "off": (SCHEDULE, LOSS_FORWARD, LOSS_MASK, RLOO_GENERATION, RLOO_LOSS),
        "cycle": (SCHEDULE, LOSS_FORWARD, LOSS_MASK, RLOO_GENERATION, RLOO_LOSS),
        "resume": (CHECKPOINTS,),
        "isolation": (LOSS_FORWARD, LOSS_MASK, RLOO_LOSS),
        "ar": (LOSS_FORWARD, LOSS_MASK, RLOO_LOSS),
    },
}
"""The checks of each trainer, in order, with the TRL facts each relies on. Each but `off` needs the run of
`off`; `resume` needs the run of `cycle`."""


@dataclasses.dataclass
class CheckResult:
    """One check of one trainer (`name`, e.g. `"grpo off"`): the codes of the `facts` it relies on, its
    `status` (`PASS`; `FAIL`: the facts it found `broken`; `ERROR`: it could not run to a verdict; `SKIP`: a
    check it needs did not pass), what it measured or why it failed (`detail`), and its `seconds`."""

    name: str
    facts: tuple[str, ...]
    status: str = "PASS"
    detail: str = ""
    seconds: float = 0.0
    broken: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """Whether the check passed."""
        return self.status == "PASS"

    def line(self) -> str:
        # A relation of a user's class relies on no fact by itself: the facts it found broken, if any.
        facts = " ".join(self.facts or self.broken) or "-"
        return f"{self.status:<5} {facts:<20} {self.name}: {self.detail} ({self.seconds:.1f} s)"


class Relation(AssertionError):
    """A relation of the contract that does not hold: the update is not the method's (`facts`: the codes of
    the facts it shows broken, where it tells)."""

    def __init__(self, message: str, facts: tuple[str, ...] = ()):
        super().__init__(message)
        self.facts = facts


class TRLFails(Exception):
    """TRL's own trainer fails on this machine: nothing can be compared with it, and no fact is shown
    broken."""


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str) -> float:
    """The largest `|actual - expected|` relative to the largest `|expected|`; raises `Relation` above
    `tolerance`."""
    if not expected.numel():
        return 0.0
    scale = float(expected.abs().max()) or 1.0
    difference = float((actual.double() - expected.double()).abs().max()) / scale
    # NaN fails too.
    if not difference <= tolerance:
        raise Relation(f"{what}: relative difference {difference:.3g} > {tolerance:g}")
    return difference


def exactly_zero(values: torch.Tensor, what: str, facts: tuple[str, ...] = ()) -> None:
    """Raises `Relation` (showing `facts` broken) unless every one of `values` is exactly zero."""
    nonzero = int(torch.count_nonzero(values))
    if nonzero:
        raise Relation(f"{what}: {nonzero} non-zero values, the largest {float(values.abs().max()):.3g}", facts)


@dataclasses.dataclass
class Passes:
    """What a run did: TRL's log-prob forwards with and without gradient, backward passes, optimizer
    steps."""

    forwards: int = 0
    no_grad_forwards: int = 0
    backwards: int = 0
    steps: int = 0
    logps: list[torch.Tensor] = dataclasses.field(default_factory=list, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.forwards}/{self.no_grad_forwards}/{self.backwards}/{self.steps}"


def log_prob_forward_class(trainer_class: type) -> type:
    """The class whose log-prob forward a trainer of `trainer_class` runs beneath trl_lopti's hooks (TRL's
    trainer, or a user's class that overrides the forward)."""
    return defining_class(trainer_class, "_get_per_token_logps_and_entropies")


@contextlib.contextmanager
def observed_forwards(trl_class: type) -> Iterator[Passes]:
    """Counts the calls of the log-prob forward of `trl_class` (TRL's own) in the block, and keeps the
    log-probabilities it returned with gradient, each keeping its `.grad`."""
    name = "_get_per_token_logps_and_entropies"
    forward = trl_class.__dict__[name]
    passes = Passes()

    def observing(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        if torch.is_grad_enabled():
            passes.forwards += 1
        else:
            passes.no_grad_forwards += 1
        if output[0].requires_grad:
            output[0].retain_grad()
            passes.logps.append(output[0])
        return output

    setattr(trl_class, name, observing)
    try:
        yield passes
    finally:
        setattr(trl_class, name, forward)


def candidate_loss_types() -> tuple[str, ...]:
    """TRL 1.16's loss types and those the installed `GRPOConfig` names in its help (one it does not know is
    skipped: its loss raises "Unknown loss type")."""
    help_text = trl.GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    named = re.search(r"Supported values are (.+?)\.\s", help_text)
    found = re.findall(r"'(\w+)'", named.group(1)) if named else []
    return tuple(dict.fromkeys([*KNOWN_LOSS_TYPES, *found]))


class Contract:
    """The runs and relations of `trl-lopti check` on one device and precision, in a folder of its own."""

    def __init__(self, folder: Path, device: str, precision: str):
        self.folder = folder
        self.device = device
        self.precision = precision
        self.tolerance = TOLERANCES[precision]
        # Sampled tokens lie on both sides of eta 0.5, so that both Lopti passes train.
        self.model_path = build_tiny_model(folder / "model", seed=0, device=device, **PEAKED_TINY_MODEL)
        dtype = torch.float64 if precision == "fp64" else None
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        model.save_pretrained(self.model_path)
        self.initial = {name: parameter.detach().to(device) for name, parameter in model.named_parameters()}
        self.trl_passes: dict[str, Passes] = {}
        self.cycle_runs: dict[str, Any] = {}

    def config(self, trainer: str, name: str, lopti: bool = True, config_class: type | None = None, **overrides: Any):
        """A run's config (`lopti=False`: TRL's own; `config_class`: a user's Lopti config): 2 generation
        batches of 8 completions, each trained in 2 optimizer steps of plain SGD per pass (TRL computes pi_old:
        off-policy), on this device and precision; RLOO's with a reference model (its forward follows pi_old's,
        fact R1), whose KL penalises the rewards."""
        fields = {
            "output_dir": str(self.folder / name),
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "steps_per_generation": 2,
            "gradient_accumulation_steps": 1,
            "num_train_epochs": 1,
            "max_completion_length": 6,
            "seed": 0,
            "optim": "sgd",
            "learning_rate": 0.5,
            "lr_scheduler_type": "constant",
            "max_grad_norm": 0.0,
            "logging_steps": 1,
            "report_to": "none",
            "save_strategy": "no",
            "disable_tqdm": True,
            "model_init_kwargs": {"dtype": "auto"},
            "use_cpu": self.device == "cpu",
            "bf16": self.precision == "bf16",
            "fp16": self.precision == "fp16",
            "beta": 0.04 if trainer == "rloo" else 0.0,
        }
        fields.update(overrides)
        if config_class is not None:
            return config_class(**fields)
        return TRAINERS[trainer].config_class(**fields) if lopti else TRL_CONFIGS[trainer](**fields)

    def trainer(self, trainer_class: type, args: Any):
        prompts = Dataset.from_dict({"prompt": [f"Count to {number}:" for number in range(4)]})
        return trainer_class(model=self.model_path, reward_funcs=token_parity_reward, args=args, train_dataset=prompts)

    def train(self, trainer_class: type, args: Any, checkpoint: str | None = None) -> tuple[Any, Passes]:
        """Trains a run (from `checkpoint`): the trainer, and what it did (backward passes: those that reach
        the input embedding)."""
        trainer = self.trainer(trainer_class, args)
        backwards = []
        trainer.model.get_input_embeddings().weight.register_post_accumulate_grad_hook(lambda _: backwards.append(1))
        with observed_forwards(log_prob_forward_class(trainer_class)) as passes:
            trainer.train(resume_from_checkpoint=checkpoint)
        passes.backwards = len(backwards)
        passes.steps = trainer.state.global_step
        return trainer, passes

    def moved_like(self, trainer, expected) -> float:
        """How far `trainer`'s parameters moved from the initial ones unlike `expected`'s (relative, the
        largest)."""
        differences = [0.0]
        moved = False
        pairs = zip(trainer.model.named_parameters(), expected.model.named_parameters(), strict=True)
        for (name, parameter), (_, expected_parameter) in pairs:
            move = expected_parameter.detach() - self.initial[name]
            moved = moved or bool(move.any())
            differences.append(close(parameter.detach() - self.initial[name], move, self.tolerance, name))
        if not moved:
            raise Relation("no parameter moved")
        return max(differences)

    # ---------------------------------------------------------------------------------------------------- the checks
    def off(self, trainer: str) -> str:
        trl_class = TRAINERS[trainer].trl_trainer_class
        try:
            plain, self.trl_passes[trainer] = self.train(
                trl_class, self.config(trainer, f"{trainer}-trl", lopti=False)
            )
        except Exception as error:
            message = f"TRL's own {trl_class.__name__} fails on this machine: {type(error).__name__}: {error}"
            raise TRLFails(message) from error
        config = self.config(trainer, f"{trainer}-off", advantage_reweighting_alpha=0.0, lopti_threshold=None)
        lopti, passes = self.train(TRAINERS[trainer], config)
        if passes != self.trl_passes[trainer]:
            raise Relation(f"passes {passes}, TRL's {self.trl_passes[trainer]}")
        difference = self.moved_like(lopti, plain)
        return f"passes {passes} and parameters: {trl_class.__name__}'s to {difference:.2g}"

    def cycle_config(self, trainer: str, name: str, **overrides: Any):
        """The config of a Lopti cycle: with REINFORCE++ for GRPO, which exercises fact G3."""
        if trainer == "grpo":
            overrides["advantage_estimator"] = "reinforce_plus_plus"
        return self.config(trainer, name, **overrides)

    def cycle(self, trainer: str) -> str:
        # A checkpoint at every optimizer step, for `resume`.
        config = self.cycle_config(trainer, f"{trainer}-cycle", save_strategy="steps", save_steps=1)
        run, passes = self.train(TRAINERS[trainer], config)
        self.cycle_runs[trainer] = run
        trl_passes = self.trl_passes[trainer]
        twice = Passes(
            2 * trl_passes.forwards, trl_passes.no_grad_forwards, 2 * trl_passes.backwards, 2 * trl_passes.steps
        )
        if passes != twice:
            raise Relation(f"passes {passes}, TRL's {trl_passes}: not twice, or an extra forward")
        shares = [e["lopti/low_token_share"] for e in run.state.log_history if "lopti/low_token_share" in e]
        if not shares or not 0 < shares[0] < 1:
            raise Relation(f"the split left a pass without tokens (low-token share {shares})")
        counts = f"forwards with gradient / without / backward / optimizer steps {passes}, TRL's {trl_passes}"
        return f"{counts}; low-token share {shares[0]:.2f}"

    def resume(self, trainer: str) -> str:
        run = self.cycle_runs[trainer]
        # The checkpoint after the first pass's optimizer steps: between the passes.
        steps = run.args.lopti_pass_micro_steps // run.args.gradient_accumulation_steps
        checkpoint = Path(run.args.output_dir) / f"checkpoint-{steps}"
        config = self.cycle_config(trainer, f"{trainer}-resumed")
        resumed, _ = self.train(TRAINERS[trainer], config, str(checkpoint))
        difference = self.moved_like(resumed, run)
        return f"from {checkpoint.name}, between the passes: the uninterrupted parameters to {difference:.2g}"

    def losses(self, trainer: str) -> dict[str, str | Relation]:
        """The `isolation` and `ar` relations at equal parameters, over every loss configuration: for each, a
        detail or the first relation that failed."""
        trl_class = TRAINERS[trainer].trl_trainer_class
        configurations = [{}]
        if trainer == "grpo":
            # A KL term at token level (AR refuses one with a sequence's shared ratio).
            configurations = [
                {"loss_type": loss, "importance_sampling_level": level, "beta": 0.04 if level == "token" else 0.0}
                for loss in candidate_loss_types()
                for level in ("token", "sequence")
            ]
        beta = 0.04 if trainer == "grpo" else 0.0
        generator = self.trainer(TRAINERS[trainer], self.config(trainer, "batch", beta=beta))
        batch, eta = generation_batch_off_policy(generator)
        mask = batch["completion_mask"].bool()
        old_probabilities = batch["old_per_token_logps"].exp()
        low_mask = (old_probabilities < eta) & mask
        weights = 0.3 * old_probabilities + 0.7
        worst = {"isolation": 0.0, "ar": 0.0}
        failures = {}
        checked = []
        for configuration in configurations:
            # The configs first: building one resets accelerate's state, which a trainer built before would
            # need.
            whole = self.config(trainer, "loss", **configuration, lopti_threshold=None)
            plain = self.config(trainer, "loss", **configuration, lopti_threshold=None, advantage_reweighting_alpha=0)
            lopti = self.trainer(TRAINERS[trainer], self.config(trainer, "loss", **configuration, lopti_threshold=eta))
            what = f"{trainer} {' '.join(map(str, configuration.values()))}".strip()
            try:
                unweighted = self.gradients(lopti, trl_class, batch, plain, kl=False)
            except ValueError as error:
                # A loss type this TRL does not know.
                if "loss type" in str(error).lower():
                    continue
                raise
            checked.append(configuration.get("loss_type"))
            with self.failure(failures, "isolation"):
                expected = self.gradients(lopti, trl_class, batch, whole)
                exactly_zero(expected[~mask], f"{what}: the whole loss's padding tokens", (LOSS_MASK.code,))
                for pass_index, (group, active) in enumerate((("low", low_mask), ("high", mask & ~low_mask))):
                    gradient = self.gradients(lopti, trl_class, batch, lopti.args, pass_index)
                    exactly_zero(gradient[~active], f"{what}: the {group} pass's inactive tokens")
                    difference = close(gradient[active], expected[active], self.tolerance, f"{what}: {group} pass")
                    worst["isolation"] = max(worst["isolation"], difference)
            with self.failure(failures, "ar"):
                reweighted = self.gradients(lopti, trl_class, batch, whole, kl=False)
                exactly_zero(reweighted[unweighted == 0], f"{what}: AR where plain TRL has no gradient")
                try:
                    difference = close(reweighted, weights * unweighted, self.tolerance, f"{what}: AR")
                except Relation as error:
                    # At token level GRPO's loss gets AR's token-level advantages, which it must weight token by
                    # token (fact G1).
                    token_level = trainer == "grpo" and configuration["importance_sampling_level"] == "token"
                    raise Relation(str(error), (GRPO_LOSS.code,) if token_level else ()) from None
                worst["ar"] = max(worst["ar"], difference)
        count = "its loss"
        if trainer == "grpo":
            count = f"{len(checked)} configurations ({', '.join(dict.fromkeys(checked))}; token, sequence)"
        isolation = f"{count}: inactive tokens exactly 0, each pass = the whole loss to {worst['isolation']:.2g}"
        ar = f"{count}: each token's gradient = w(t) x plain TRL's to {worst['ar']:.2g}"
        return {"isolation": failures.get("isolation", isolation), "ar": failures.get("ar", ar)}

    @staticmethod
    @contextlib.contextmanager
    def failure(failures: dict[str, Relation], relation: str) -> Iterator[None]:
        """Records the first `Relation` of kind `relation` that fails in a block as `failures[relation]`."""
        try:
            yield
        except Relation as error:
            failures.setdefault(relation, error)

    @staticmethod
    def gradients(trainer, trl_class: type, batch: dict, args, pass_index: int = 0, kl: bool = True) -> torch.Tensor:
        """The gradient of the trainer's loss with `args`, in pass `pass_index`, through each log-probability
        TRL's own forward returned (`kl=False`: without the KL term, at `beta` 0)."""
        step = pass_index * args.lopti_pass_micro_steps
        beta = trainer.beta if kl else 0.0
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        with temporarily_set(trainer, args=args, _step=step, beta=beta), observed_forwards(trl_class) as passes:
            trainer.compute_loss(trainer.model, dict(batch)).backward()
        trainer.model.zero_grad(set_to_none=True)
        return passes.logps[-1].grad

    # ---------------------------------------------------------------------------------------------------- a user's class
    def composition_config(self, composition: "Composition", name: str, **overrides: Any):
        """A run's config for a user's trainer class: its config class, with the fields of `config`; no KL term
        in GRPO's loss unless asked (AR's general form refuses one)."""
        if composition.family == "grpo":
            overrides.setdefault("beta", 0.0)
        return self.config(composition.family, name, config_class=composition.config_class, **overrides)

    def composition_train(self, composition: "Composition") -> str:
        """A Lopti cycle with AR of the user's class trains with every runtime check on, both passes, and moves
        the parameters."""
        config = self.composition_config(composition, "composition-cycle", advantage_reweighting_alpha=0.3)
        run, passes = self.train(composition.trainer_class, config)
        shares = [e["lopti/low_token_share"] for e in run.state.log_history if "lopti/low_token_share" in e]
        pass_losses = [e for e in run.state.log_history if "lopti/loss_high_pass" in e]
        if not shares or not 0 < shares[0] < 1 or not pass_losses:
            raise Relation(f"the split left a pass without tokens (low-token share {shares})")
        moved = max(
            float((parameter.detach() - self.initial[name]).abs().max())
            for name, parameter in run.model.named_parameters()
        )
        if not moved:
            raise Relation("no parameter moved")
        return f"{passes.steps} optimizer steps, both passes, low-token share {shares[0]:.2f}, every runtime check on"

    def composition_passes(self, composition: "Composition") -> str:
        """
        The `passes` relation of a user's trainer class at equal parameters, for each configuration of its loss: the
        parameter gradients of the low and the high pass (both groups hold tokens) add up to the class's own update.
        It fails where part of the loss's gradient bypasses the log-probabilities and entropies of
        `self._get_per_token_logps_and_entropies` (a term computed from the logits, a forward of its own): Lopti
        cannot isolate that part, and AR cannot reweight it.
        """
        trainer_class = composition.trainer_class
        family = composition.family
        configurations = [{}]
        if family == "grpo" and defining_class(trainer_class, "_compute_loss") is trl.GRPOTrainer:
            configurations = [
                {"loss_type": loss, "importance_sampling_level": level}
                for loss in candidate_loss_types()
                for level in ("token", "sequence")
            ]
        # A reference model unlike the policy, so that a KL term in the loss has a gradient to isolate.
        beta = 0.04 if family == "grpo" else 0.0
        # AR's general form refuses a KL term: the generator trains nothing, and runs without AR.
        generator_config = self.composition_config(composition, "batch", beta=beta, advantage_reweighting_alpha=0.0)
        generator = self.trainer(trainer_class, generator_config)
        batch, eta = generation_batch_off_policy(generator)
        loss_method = composition.loss_method()
        worst = 0.0
        checked = 0
        for configuration in configurations:
            plain = self.composition_config(
                composition, "loss", **configuration, lopti_threshold=None, advantage_reweighting_alpha=0.0
            )
            lopti = self.composition_config(
                composition, "loss", **configuration, lopti_threshold=eta, advantage_reweighting_alpha=0.0
            )
            trainer = self.trainer(trainer_class, lopti)
            what = f"{trainer_class.__name__} {' '.join(map(str, configuration.values()))}".strip()
            try:
                whole = self.parameter_gradients(trainer, batch, plain, beta=beta)
            except ValueError as error:
                # A loss type this TRL does not know.
                if "loss type" in str(error).lower():
                    continue
                raise
            checked += 1
            if not torch.count_nonzero(whole):
                raise Relation(f"{what}: {loss_method} has no gradient on any parameter")
            passes = [
                self.parameter_gradients(trainer, batch, lopti, pass_index, beta)
                for pass_index in range(lopti.lopti_num_passes)
            ]
            try:
                difference = close(passes[0] + passes[1], whole, self.tolerance, f"{what}: low + high pass")
            except Relation as error:
                raise Relation(
                    f"{error}, against {loss_method}'s own update: part of its gradient does not go through the "
                    "log-probabilities and entropies that self._get_per_token_logps_and_entropies returned (a term "
                    "computed from the logits or hidden states directly, or a forward of its own), so Lopti cannot "
                    "isolate that part and AR cannot reweight it. Compute every term of the loss from that forward's "
                    "output"
                ) from None
            worst = max(worst, difference)
        if not checked:
            raise Relation(f"no configuration of {loss_method} could run (every one: an unknown loss type)")
        count = f"{checked} configurations of its loss" if checked > 1 else "its loss"
        return f"{count}: low + high pass = {loss_method}'s own update, on every parameter, to {worst:.2g}"

    @staticmethod
    def parameter_gradients(trainer, batch: dict, args, pass_index: int = 0, beta: float = 0.0) -> torch.Tensor:
        """The gradient of the trainer's loss with `args`, in pass `pass_index`, w.r.t. every parameter (flat,
        float64)."""
        step = pass_index * args.lopti_pass_micro_steps
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        trainer.model.zero_grad(set_to_none=True)
        with temporarily_set(trainer, args=args, _step=step, beta=beta):
            trainer.compute_loss(trainer.model, dict(batch)).backward()
        parameters = list(trainer.model.parameters())
        gradients = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
        flat = torch.cat([gradient.flatten().double() for gradient in gradients])
        trainer.model.zero_grad(set_to_none=True)
        return flat


@dataclasses.dataclass
class Composition:
    """A user's Lopti trainer class and the config class it trains with; `family`: `"grpo"` or `"rloo"`."""

    trainer_class: type
    config_class: type
    family: str

    def loss_method(self) -> str:
        """The loss the class trains, as `Class.method`: the first override beneath the Lopti class outside the
        TRL trainer it extends (GMPO's, a user's), else the TRL trainer's own."""
        trl_classes = self.trainer_class.trl_trainer_class.__mro__
        for name in ("_compute_loss", "compute_loss"):
            owner = defining_class(self.trainer_class, name)
            if owner is not None and owner not in trl_classes:
                return f"{owner.__name__}.{name}"
        return f"{defining_class(self.trainer_class, '_compute_loss').__name__}._compute_loss"


def composition_of(trainer_class: Any, config_class: Any = None) -> Composition:
    """
    The `Composition` to check, or a `TypeError` saying what to change.

    Args:
        trainer_class (`type`):
            A subclass of [`LoptiGRPOTrainer`] or [`LoptiRLOOTrainer`] (for example `class
            LoptiGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer)`).
        config_class (`type`, *optional*):
            Its config class; defaults to the one it trains with when given no `args`.
    """
    if not isinstance(trainer_class, type) or not issubclass(trainer_class, LoptiTrainerMixin):
        name = getattr(trainer_class, "__name__", repr(trainer_class))
        rloo = isinstance(trainer_class, type) and issubclass(trainer_class, trl.RLOOTrainer)
        lopti = "LoptiRLOOTrainer" if rloo else "LoptiGRPOTrainer"
        raise TypeError(
            f"{name} is not a Lopti trainer: compose it with one, Lopti class first, e.g. `class Lopti{name}"
            f"({lopti}, {name})`, and check that class"
        )
    family = "grpo" if issubclass(trainer_class, LoptiGRPOTrainer) else "rloo"
    default_config = default_config_class(trainer_class)
    if config_class is None:
        return Composition(trainer_class, lopti_config_class(default_config), family)
    check_config_fits(trainer_class, config_class)
    return Composition(trainer_class, lopti_config_class(config_class), family)


def generation_batch_off_policy(trainer) -> tuple[dict[str, Any], float]:
    """A generation batch of `trainer` (its TRL keys, pi_old included) moved off-policy so that ratios clip
    on some tokens and sequences, with padding, and an eta half-way in the widest gap of its pi_old near the
    median."""
    trainer.model.train()
    rows = [{"prompt": p} for p in trainer.train_dataset["prompt"][:2] for _ in range(trainer.num_generations)]
    generated = trainer._generate_and_score_completions(rows)
    batch = {key: value for key, value in generated.items() if key not in LOPTI_BATCH_KEYS}
    noise = torch.Generator().manual_seed(0)
    old = batch["old_per_token_logps"].clone()
    old += 0.3 * torch.randn(old.shape, generator=noise, dtype=torch.float64).to(old)
    advantages = batch["advantages"].clone()
    # Two sequences whose ratios leave the clip range, on their clipped side.
    old[0] += 0.5
    old[-1] -= 0.5
    advantages[0] = -advantages[0].abs() - 0.1
    advantages[-1] = advantages[-1].abs() + 0.1
    # Two completions end early: padding, which no loss may count (fact S4).
    mask = batch["completion_mask"].clone()
    mask[1, -2:] = 0
    mask[2, -1:] = 0
    batch.update(old_per_token_logps=old.clamp(max=-1e-6), advantages=advantages, completion_mask=mask)
    batch["num_items_in_batch"] = mask.sum()
    # A reference unlike the policy, so that the KL term has a gradient.
    if batch.get("ref_per_token_logps") is not None:
        ref = batch["ref_per_token_logps"]
        batch["ref_per_token_logps"] = ref + 0.3 * torch.randn(ref.shape, generator=noise, dtype=torch.float64).to(ref)
    # RLOO's old_logps: the masked sum.
    if "old_logps" in batch:
        batch["old_logps"] = (batch["old_per_token_logps"] * mask).sum(1)
    probabilities = torch.sort(batch["old_per_token_logps"].exp()[mask.bool()].double()).values
    count = len(probabilities)
    middle = probabilities[count // 4 : max(count * 3 // 4, count // 4 + 2)]
    widest = int(torch.argmax(middle[1:] - middle[:-1]))
    return batch, float(middle[widest] + middle[widest + 1]) / 2


def run_checks(
    device: str = "cpu",
    precision: str = "fp64",
    trainers: tuple[str, ...] = ("grpo", "rloo"),
    report: Callable[[CheckResult], None] | None = None,
) -> dict[str, list[CheckResult]]:
    """
    Runs every check of the contract, each to a result; a check that fails, for any reason, fails alone.

    Args:
        device (`str`):
            `"cpu"` or an accelerator's device type (`"cuda"`).
        precision (`str`):
            A key of `TOLERANCES` (`"bf16"`, `"fp16"`: autocast over float32 weights).
        trainers (`tuple[str, ...]`):
            Keys of `TRAINERS`.
        report (`Callable`, *optional*):
            Called with each result as soon as it is known.

    Returns:
        `dict[str, list[CheckResult]]`: the results of each trainer.
    """
    results = {}
    with tempfile.TemporaryDirectory(prefix="trl-lopti-check-") as folder:
        with temporarily_set(trl_contract, _verifying_contract=True), quiet():
            contract = Contract(Path(folder), device, precision)
        for trainer in trainers:
            results[trainer] = []
            losses = {}
            # The status of each check run so far, by name.
            statuses = {}
            for check, facts in CHECK_FACTS[trainer].items():
                result = CheckResult(f"{trainer} {check}", tuple(fact.code for fact in facts))
                needed = "off" if check != "resume" else "cycle"
                if check != "off" and statuses[needed] != "PASS":
                    result.status = "SKIP"
                    result.detail = f"it needs the {needed} check"
                else:
                    start = time.perf_counter()
                    try:
                        with temporarily_set(trl_contract, _verifying_contract=True), quiet():
                            if check in ("isolation", "ar"):
                                losses = losses or contract.losses(trainer)
                                outcome = losses[check]
                            else:
                                outcome = getattr(contract, check)(trainer)
                        if isinstance(outcome, Relation):
                            raise outcome
                        result.detail = outcome
                    except Exception as error:  # noqa: BLE001 - a verdict for every check, whatever breaks
                        record_failure(result, error)
                    result.seconds = time.perf_counter() - start
                statuses[check] = result.status
                results[trainer].append(result)
                if report is not None:
                    report(result)
    return results


def check_trainer_class(
    trainer_class: type,
    config_class: type | None = None,
    device: str = "cpu",
    precision: str = "fp64",
    report: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """
    The relations of the contract that a user's own Lopti trainer class can break (`trl-lopti check
    --trainer_class`), on a tiny model built here: a Lopti cycle with AR trains with every runtime check on, both
    passes, and moves the parameters (`train`); at equal parameters the low and the high pass add up to the class's
    own update on every parameter (`passes`, which finds a loss that bypasses the log-prob forward in part). That
    each pass isolates its tokens and that AR scales each token's gradient is the library's own mechanism, proven
    on TRL's trainers by `trl-lopti check`. Nothing is cached: the gate of an untested TRL keeps checking TRL's own
    trainers.

    Call it from a test suite, with a class defined anywhere (a script too):
    `assert all(result.passed for result in check_trainer_class(LoptiGMPOTrainer))`.

    Args:
        trainer_class (`type`):
            A subclass of [`LoptiGRPOTrainer`] or [`LoptiRLOOTrainer`], e.g. `class
            LoptiGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer)`.
        config_class (`type`, *optional*):
            Its config class; defaults to the one it trains with when given no `args`.
        device (`str`, *optional*, defaults to `"cpu"`):
            `"cpu"` or an accelerator's device type.
        precision (`str`, *optional*, defaults to `"fp64"`):
            A key of `TOLERANCES`.
        report (`Callable`, *optional*):
            Called with each result as soon as it is known.

    Returns:
        `list[CheckResult]`: one per relation, in order; `TypeError` where `trainer_class` is no Lopti trainer.
    """
    composition = composition_of(trainer_class, config_class)
    name = trainer_class.__name__
    results = []
    with tempfile.TemporaryDirectory(prefix="trl-lopti-check-") as folder:
        contract = None
        for check in ("train", "passes"):
            result = CheckResult(f"{name} {check}", ())
            start = time.perf_counter()
            # A relation after one that failed is not run: its failure would only repeat the first.
            if results and not results[-1].passed:
                result.status = "SKIP"
                result.detail = f"it needs the {results[-1].name.split()[-1]} relation"
            else:
                try:
                    with temporarily_set(trl_contract, _verifying_contract=True), quiet():
                        contract = contract or Contract(Path(folder), device, precision)
                        if check == "train":
                            result.detail = contract.composition_train(composition)
                        else:
                            result.detail = contract.composition_passes(composition)
                except Exception as error:  # noqa: BLE001 - a verdict for every relation, whatever breaks
                    record_failure(result, error)
            result.seconds = time.perf_counter() - start
            results.append(result)
            if report is not None:
                report(result)
    return results


def record_failure(result: CheckResult, error: Exception) -> None:
    """Records why a check failed: the facts that a runtime check or a relation found broken (`FAIL`), or an
    error that shows no fact broken (`ERROR`: TRL's own trainer failing, out of memory, ...)."""
    named = tuple(re.findall(r"(?:broke|breaks) fact ([SGR]\d) of trl_lopti", str(error)))
    result.detail = str(error)[:600]
    # A relation that fails shows an update other than the method's; it names the facts it shows broken, if any.
    if named or isinstance(error, Relation):
        result.status = "FAIL"
        result.broken = named or error.facts
    else:
        result.status = "ERROR"
        if not isinstance(error, TRLFails):
            result.detail = f"{type(error).__name__}: {result.detail}"


def verdict_of(results: list[CheckResult], key: dict[str, str], seconds: float) -> dict[str, Any]:
    """The verdict of one trainer's `results` for `key`: passed; failed, where a check named a broken fact; else
    inconclusive, where a check did not pass (an error, or a relation that names no fact: a difference beyond
    the tolerance can be a device's rounding)."""
    broken = [result for result in results if result.broken]
    unfinished = [result for result in results if result.status != "PASS"]
    verdict = {"key": key, "outcome": "passed", "seconds": round(seconds)}
    if broken:
        verdict["outcome"] = "failed"
        verdict["broken_facts"] = sorted({fact for result in broken for fact in result.broken})
        verdict["failed_checks"] = [result.line() for result in broken]
    elif unfinished:
        verdict["outcome"] = "inconclusive"
        # What went wrong, not the checks it left unrun.
        reasons = [result for result in unfinished if result.status != "SKIP"] or unfinished
        verdict["reason"] = "; ".join(f"{result.name}: {result.detail}" for result in reasons)
    return verdict


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keeps what TRL, transformers and the trainers print out of the check's own lines."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)


def main(argv: list[str]) -> int:
    """`trl-lopti check`: every check, each printed as it ends, then the verdict of each trainer, cached
    where it is conclusive. Exit code 0: passed; 1: a fact broke; 3: inconclusive (nothing cached)."""
    devices = ["cpu"]
    if torch.accelerator.is_available():
        devices.append(torch.accelerator.current_accelerator().type)
    parser = argparse.ArgumentParser(
        prog="trl-lopti check", description="trl_lopti's contract on this machine's stack"
    )
    parser.add_argument("--device", choices=devices, default=devices[-1], help="default: %(default)s")
    precision_help = "the run's mixed precision (fp64: float64 weights, the tightest check); default: TRL's, bf16"
    parser.add_argument("--precision", choices=list(TOLERANCES), help=precision_help)
    parser.add_argument("--trainers", nargs="+", choices=list(TRAINERS), default=list(TRAINERS))
    trainer_class_help = (
        "MODULE.CLASS of your own Lopti trainer (e.g. my_trainers.LoptiGMPOTrainer, imported from the current "
        "folder): checks its relations instead of TRL's trainers, in fp64 unless --precision says otherwise"
    )
    parser.add_argument("--trainer_class", help=trainer_class_help)
    parser.add_argument("--config_class", help="MODULE.CLASS of its config; default: the one it trains with")
    # Where the trainers' gate reads the verdict of the check it runs.
    parser.add_argument("--verdict_file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # A process of its own, on a tiny model: one thread is fastest, and fast beside other work.
    torch.set_num_threads(1)
    if args.trainer_class is not None or args.config_class is not None:
        return main_trainer_class(args.trainer_class, args.config_class, args.device, args.precision or "fp64")
    args.precision = args.precision or "bf16"
    keys = {trainer: trl_contract.verdict_key(trainer, args.device, args.precision) for trainer in args.trainers}
    key = keys[args.trainers[0]]
    print(
        f"trl-lopti check: {', '.join(f'{name} {key[name]}' for name in list(key)[:5])}; {key['device']}, {args.precision}"
    )
    start = time.perf_counter()
    try:
        results = run_checks(args.device, args.precision, tuple(args.trainers), lambda r: print(r.line(), flush=True))
    except KeyboardInterrupt:
        print("interrupted: no verdict, nothing cached")
        return 130
    seconds = time.perf_counter() - start
    outcomes = []
    for trainer in args.trainers:
        verdict = trl_contract.write_verdict(verdict_of(results[trainer], keys[trainer], seconds))
        outcomes.append(verdict["outcome"])
        where = verdict.get("cached_in") or f"not cached: {verdict.get('cache_error', 'the next run checks again')}"
        broken = " ".join(verdict.get("broken_facts", []))
        print(f"{trainer}: {verdict['outcome']}{', broken facts ' + broken if broken else ''} ({where})")
        if args.verdict_file:
            Path(args.verdict_file).write_text(json.dumps(verdict))
    every = [result for trainer in args.trainers for result in results[trainer]]
    unfinished = [result for result in every if result.status != "PASS"]
    if "failed" in outcomes:
        failed = [result for result in every if result.status == "FAIL"]
        broken = " ".join(sorted({fact for result in every for fact in result.broken}))
        print(f"FAILED: {len(failed)} of {len(every)} checks in {seconds:.0f} s, broken facts {broken}")
        return 1
    if "inconclusive" in outcomes:
        print(
            f"INCONCLUSIVE: {len(unfinished)} of {len(every)} checks did not pass in {seconds:.0f} s, and none named "
            f"a fact of trl_lopti broken: nothing cached. {trl_contract.SKIP_CHECK_VARIABLE}=1 trains without the "
            "check"
        )
        return 3
    print(f"passed: {len(every)} of {len(every)} checks in {seconds:.0f} s")
    return 0


def main_trainer_class(trainer_path: str | None, config_path: str | None, device: str, precision: str) -> int:
    """`trl-lopti check --trainer_class MODULE.CLASS [--config_class MODULE.CLASS]`: each relation, printed as it
    ends, then the summary. Exit code 0: passed; 1: a relation failed; 2: the class could not be checked."""
    try:
        if trainer_path is None:
            raise CliError("--config_class needs --trainer_class, the trainer it configures")
        trainer_class = import_class(trainer_path, "--trainer_class")
        config_class = None if config_path is None else import_class(config_path, "--config_class")
        composition_of(trainer_class, config_class)
    except (CliError, TypeError) as error:
        print(f"trl-lopti check: {error}")
        return 2
    print(
        f"trl-lopti check: {trainer_class.__module__}.{trainer_class.__qualname__} on trl {trl.__version__}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}; {device}, {precision}"
    )
    start = time.perf_counter()
    try:
        results = check_trainer_class(trainer_class, config_class, device, precision, lambda r: print(r.line()))
    except KeyboardInterrupt:
        print("interrupted")
        return 130
    seconds = time.perf_counter() - start
    failed = [result for result in results if result.status in ("FAIL", "ERROR")]
    skipped = [result for result in results if result.status == "SKIP"]
    if failed or skipped:
        not_run = f" ({len(skipped)} not run)" if skipped else ""
        print(
            f"FAILED: {len(failed)} of {len(results)} relations of {trainer_class.__name__}{not_run} in {seconds:.0f} s"
        )
        return 1
    print(f"passed: {len(results)} of {len(results)} relations of {trainer_class.__name__} in {seconds:.0f} s")
    return 0
