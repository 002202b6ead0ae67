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
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM
from transformers.utils import logging

from .grpo_trainer import LoptiGRPOTrainer
from .lopti_mixin import LOPTI_BATCH_KEYS
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
from .utils import temporarily_set


TOLERANCES = {"fp64": 1e-6, "fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}
"""The relative tolerance of a relation, by precision: TRL's fused log-prob head computes in float32 under
float64 weights, and half precision rounds to its mantissa. Zeros must be exact in every precision."""

KNOWN_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
"""GRPO's loss types in TRL 1.16, tried beside those the installed `GRPOConfig`'s help names."""

TRAINERS = {"grpo": LoptiGRPOTrainer, "rloo": LoptiRLOOTrainer}

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

    def line(self) -> str:
        facts = " ".join(self.facts) or "-"
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


@contextlib.contextmanager
def observed_forwards(trl_class: type) -> Iterator[Passes]:
    """Counts the calls of TRL's own log-prob forward (`trl_class`'s) in the block, and keeps the
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

    def config(self, trainer: str, name: str, lopti: bool = True, **overrides: Any):
        """A run's config (`lopti=False`: TRL's own): 2 generation batches of 8 completions, each trained in
        2 optimizer steps of plain SGD per pass (TRL computes pi_old: off-policy), on this device and
        precision; RLOO's with a reference model (its forward follows pi_old's, fact R1), whose KL penalises
        the rewards."""
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
        config_class = TRAINERS[trainer].config_class
        return config_class(**fields) if lopti else getattr(trl, config_class.__name__.removeprefix("Lopti"))(**fields)

    def trainer(self, trainer_class: type, args: Any):
        prompts = Dataset.from_dict({"prompt": [f"Count to {number}:" for number in range(4)]})
        return trainer_class(self.model_path, token_parity_reward, args, prompts)

    def train(self, trainer_class: type, args: Any, checkpoint: str | None = None) -> tuple[Any, Passes]:
        """Trains a run (from `checkpoint`): the trainer, and what it did (backward passes: those that reach
        the input embedding)."""
        trainer = self.trainer(trainer_class, args)
        backwards = []
        trainer.model.get_input_embeddings().weight.register_post_accumulate_grad_hook(lambda _: backwards.append(1))
        with observed_forwards(getattr(trainer_class, "trl_trainer_class", trainer_class)) as passes:
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
                difference = close(reweighted, weights * unweighted, self.tolerance, f"{what}: AR")
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


def record_failure(result: CheckResult, error: Exception) -> None:
    """Records why a check failed: the facts that a runtime check or a relation found broken (`FAIL`), or an
    error that shows no fact broken (`ERROR`: TRL's own trainer failing, out of memory, ...)."""
    named = tuple(re.findall(r"broke fact ([SGR]\d) of trl_lopti", str(error)))
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
    precision_help = (
        "the run's mixed precision (fp64: float64 weights, the tightest check); default: TRL's, %(default)s"
    )
    parser.add_argument("--precision", choices=list(TOLERANCES), default="bf16", help=precision_help)
    parser.add_argument("--trainers", nargs="+", choices=list(TRAINERS), default=list(TRAINERS))
    # Where the trainers' gate reads the verdict of the check it runs.
    parser.add_argument("--verdict_file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # A process of its own, on a tiny model: one thread is fastest, and fast beside other work.
    torch.set_num_threads(1)
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
