"""`trl-lopti check`: trl_lopti's contract with TRL, verified on this machine's own stack (TRL, transformers, torch, device).

On a tiny random model built here (nothing is downloaded), `LoptiGRPOTrainer` and `LoptiRLOOTrainer` are checked by
relations against TRL's own trainers and losses, `CHECKS` (docs/releases.md says what each one asserts). Every training
run in them runs the runtime checks of the TRL facts (`trl_lopti.trl_contract`), so a broken fact fails its check with the
fact's number. Tolerances, relative to the largest value compared: `TOLERANCES` (TRL's fused log-prob head computes in
float32 under float64 weights); zeros must be exact in every precision.
"""

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import trl_contract  # (checks the TRL version before TRL is imported)


# isort: split
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM
from transformers.utils import logging

import trl_lopti

from .config import as_lopti_config
from .lopti_mixin import LOPTI_BATCH_KEYS
from .models import PEAKED_TINY_MODEL, build_tiny_model
from .tasks import token_parity_reward
from .utils import temporarily_set


TOLERANCES = {"fp64": 1e-6, "fp32": 1e-4, "bf16": 2e-2}
"""The relative tolerance of a relation, by precision."""
KNOWN_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
"""GRPO's loss types in TRL 1.16, tried beside those the installed `GRPOConfig`'s help names."""
CHECKS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "off": (("S1", "S2", "S3", "S5", "S6"), None),
    "cycle": (("S1", "S2", "S3", "S5", "S6"), "off"),
    "resume": (("S4",), "cycle"),
    "isolation": (("S3", "S6"), "off"),
    "ar": (("S3", "S6"), "off"),
    "upgrade": ((), None),
}
"""The checks, in order: the TRL facts each relies on besides its trainer's own (`TRAINER_FACTS`), and the check whose
run it needs."""
TRAINER_FACTS = {"grpo": {"off": ("G2",), "cycle": ("G2", "G3", "G4"), "isolation": ("G1",), "ar": ("G1",)},
                 "rloo": {"off": ("R1", "R2"), "cycle": ("R1", "R2"), "isolation": ("R2",), "ar": ("R2",)}}  # fmt: skip


@dataclasses.dataclass
class CheckResult:
    """One check: its `name`, the TRL `facts` it relies on, whether it `passed`, what it measured or why it failed
    (`detail`), its `seconds`, the facts found broken (`broken`), and the `error` of a failed one."""

    name: str
    facts: tuple[str, ...]
    passed: bool
    detail: str
    seconds: float = 0.0
    broken: tuple[str, ...] = ()
    error: Exception | None = None

    def line(self) -> str:
        facts = " ".join(self.facts) or "-"
        return f"{'PASS' if self.passed else 'FAIL'}  {facts:<20} {self.name}: {self.detail} ({self.seconds:.1f} s)"


class Relation(AssertionError):
    """A relation of the contract that does not hold (`facts`: the TRL facts it shows broken, where it tells)."""

    def __init__(self, message: str, facts: tuple[str, ...] = ()):
        super().__init__(message)
        self.facts = facts


class TRLFails(Relation):
    """TRL's own trainer fails on this machine: no relation to it can be checked (no fact of trl_lopti is shown broken)."""


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str) -> float:
    """The largest `|actual - expected|` relative to the largest `|expected|`; raises `Relation` above `tolerance`."""
    if not expected.numel():
        return 0.0
    difference = float((actual.double() - expected.double()).abs().max()) / (float(expected.abs().max()) or 1.0)
    if not difference <= tolerance:  # NaN fails too
        raise Relation(f"{what}: relative difference {difference:.3g} > {tolerance:g}")
    return difference


def exactly_zero(values: torch.Tensor, what: str, facts: tuple[str, ...] = ()) -> None:
    """Raises `Relation` (showing `facts` broken) unless every one of `values` is exactly zero."""
    if nonzero := int(torch.count_nonzero(values)):
        raise Relation(f"{what}: {nonzero} non-zero values, the largest {float(values.abs().max()):.3g}", facts)


@contextlib.contextmanager
def observed_forwards(trl_class: type) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
    """Observes TRL's own log-prob forward (`trl_class`'s) in the block: its calls without and with gradient, and the
    log-probabilities it returned with gradient (each keeping its `.grad`)."""
    calls, kept, name = [0, 0], [], "_get_per_token_logps_and_entropies"
    forward = trl_class.__dict__[name]

    def observing(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        calls[torch.is_grad_enabled()] += 1
        if output[0].requires_grad:
            output[0].retain_grad()
            kept.append(output[0])
        return output

    setattr(trl_class, name, observing)
    try:
        yield calls, kept
    finally:
        setattr(trl_class, name, forward)


def candidate_loss_types() -> tuple[str, ...]:
    """TRL 1.16's loss types and those the installed `GRPOConfig` names in its help (one it does not know is skipped:
    its loss raises "Unknown loss type")."""
    named = re.search(
        r"Supported values are (.+?)\.\s", trl.GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    )
    return tuple(dict.fromkeys((*KNOWN_LOSS_TYPES, *re.findall(r"'(\w+)'", named.group(1) if named else ""))))


def classes(trainer: str) -> tuple[type, type, type, type]:
    """TRL's config and trainer, and the Lopti config and trainer, of `trainer` ("grpo" or "rloo")."""
    name = trainer.upper()
    return (*(getattr(trl, f"{name}{kind}") for kind in ("Config", "Trainer")),
            *(getattr(trl_lopti, f"Lopti{name}{kind}") for kind in ("Config", "Trainer")))  # fmt: skip


class Contract:
    """The runs and relations of `trl-lopti check` on one device and precision, in a folder of its own."""

    def __init__(self, folder: Path, device: str, precision: str):
        self.folder, self.device, self.precision, self.tolerance = folder, device, precision, TOLERANCES[precision]
        # sampled tokens lie on both sides of eta 0.5, so that both Lopti passes train
        self.model_path = build_tiny_model(folder / "model", seed=0, device=device, **PEAKED_TINY_MODEL)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=torch.float64 if precision == "fp64" else None
        )
        model.save_pretrained(self.model_path)
        self.initial = {name: p.detach().to(device) for name, p in model.named_parameters()}
        self.trl_passes: dict[str, list[int]] = {}
        self.cycle_runs: dict[str, tuple[Any, dict[str, Any]]] = {}

    def fields(self, name: str, **overrides: Any) -> dict[str, Any]:
        """A run's config fields: 2 generation batches of 8 completions, each trained in 2 optimizer steps of plain SGD
        per pass (TRL computes pi_old: off-policy), on this device and precision; RLOO's with a reference model (its
        forward follows pi_old's, fact R1), whose KL penalises the rewards."""
        return {
            **dict(output_dir=str(self.folder / name), per_device_train_batch_size=4, num_generations=4),
            **dict(steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=6, seed=0),
            **dict(optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1),
            **dict(report_to="none", save_strategy="no", disable_tqdm=True, model_init_kwargs={"dtype": "auto"}),
            **dict(num_train_epochs=1, use_cpu=self.device == "cpu", bf16=self.precision == "bf16"),
            **dict(beta=0.04 if name.startswith("rloo") else 0.0),
            **overrides,
        }

    def trainer(self, trainer_class: type, args: Any):
        prompts = Dataset.from_dict({"prompt": [f"Count to {number}:" for number in range(4)]})
        return trainer_class(self.model_path, token_parity_reward, args, prompts)

    def train(self, trainer_class: type, args: Any, checkpoint: str | None = None) -> tuple[Any, list[int]]:
        """Trains a run (from `checkpoint`); returns the trainer and its passes: TRL's log-prob forwards with gradient
        and without, backward passes (reaching the input embedding), optimizer steps."""
        trainer, backward = self.trainer(trainer_class, args), []
        trainer.model.get_input_embeddings().weight.register_post_accumulate_grad_hook(lambda _: backward.append(1))
        with observed_forwards(getattr(trainer_class, "trl_trainer_class", trainer_class)) as (calls, _):
            trainer.train(resume_from_checkpoint=checkpoint)
        return trainer, [calls[1], calls[0], len(backward), trainer.state.global_step]

    def moved_like(self, trainer, expected) -> float:
        """How far `trainer`'s parameters moved from the initial ones unlike `expected`'s (relative, the largest)."""
        moves = {name: (p.detach() - self.initial[name], q.detach() - self.initial[name]) for (name, p), (_, q)
                 in zip(trainer.model.named_parameters(), expected.model.named_parameters(), strict=True)}  # fmt: skip
        if not any(move.any() for _, move in moves.values()):
            raise Relation("no parameter moved")
        return max(close(actual, move, self.tolerance, name) for name, (actual, move) in moves.items())

    # ---------------------------------------------------------------------------------------------------- the checks
    def off(self, trainer: str) -> str:
        trl_config, trl_trainer, lopti_config, lopti_trainer = classes(trainer)
        try:
            plain, self.trl_passes[trainer] = self.train(trl_trainer, trl_config(**self.fields(f"{trainer}-trl")))
        except Exception as error:
            message = f"TRL's own {trl_trainer.__name__} fails on this machine: {type(error).__name__}: {error}"
            raise TRLFails(message) from error
        fields = self.fields(f"{trainer}-off", advantage_reweighting_alpha=0.0, lopti_threshold=None)
        lopti, passes = self.train(lopti_trainer, lopti_config(**fields))
        if passes != self.trl_passes[trainer]:
            raise Relation(f"passes {passes}, TRL's {self.trl_passes[trainer]}")
        differences = [self.moved_like(lopti, plain)]
        for key in ("loss", "grad_norm"):
            logged = [torch.tensor([e[key] for e in t.state.log_history if key in e]) for t in (lopti, plain)]
            differences.append(close(*logged, self.tolerance, key))
        return f"losses, gradient norms, parameters: {trl_trainer.__name__}'s to {max(differences):.2g}"

    def cycle(self, trainer: str) -> str:
        _, _, lopti_config, lopti_trainer = classes(trainer)
        estimator = {"advantage_estimator": "reinforce_plus_plus"} if trainer == "grpo" else {}  # facts G3, G4
        fields = self.fields(
            f"{trainer}-cycle", log_completions=True, save_strategy="steps", save_steps=1, **estimator
        )
        run, passes = self.train(lopti_trainer, lopti_config(**fields))
        self.cycle_runs[trainer] = run, fields
        forwards, no_grad, backward, steps = self.trl_passes[trainer]
        if passes != [2 * forwards, no_grad, 2 * backward, 2 * steps]:
            raise Relation(f"passes {passes}, TRL's {self.trl_passes[trainer]}: not twice, or an extra forward")
        shares = [e["lopti/low_token_share"] for e in run.state.log_history if "lopti/low_token_share" in e]
        if not shares or not 0 < shares[0] < 1:
            raise Relation(f"the split left a pass without tokens (low-token share {shares})")
        passes = f"{'/'.join(map(str, passes))}, TRL's {forwards}/{no_grad}/{backward}/{steps}"
        return (
            f"forwards with gradient / without / backward / optimizer steps {passes}; low-token share {shares[0]:.2f}"
        )

    def resume(self, trainer: str) -> str:
        _, _, lopti_config, lopti_trainer = classes(trainer)
        run, fields = self.cycle_runs[trainer]
        between = run.args.lopti_pass_micro_steps // run.args.gradient_accumulation_steps  # optimizer steps in a pass
        checkpoint = Path(run.args.output_dir) / f"checkpoint-{between}"
        fields = {**fields, "output_dir": str(self.folder / f"{trainer}-resumed"), "save_strategy": "no"}
        resumed, _ = self.train(lopti_trainer, lopti_config(**fields), str(checkpoint))
        difference = self.moved_like(resumed, run)
        return f"from {checkpoint.name}, between the passes: the uninterrupted parameters to {difference:.2g}"

    def losses(self, trainer: str) -> dict[str, str | Relation]:
        """The `isolation` and `ar` relations at equal parameters, over every loss configuration: for each, a detail or
        the first relation that failed."""
        _, trl_trainer, lopti_config, lopti_trainer = classes(trainer)
        configurations = [{}]
        if trainer == "grpo":  # with a KL term at token level (AR refuses one with a sequence's shared ratio)
            configurations = [
                dict(loss_type=loss, importance_sampling_level=level, beta=0.04 if level == "token" else 0.0)
                for loss in candidate_loss_types()
                for level in ("token", "sequence")
            ]
        generator = self.trainer(lopti_trainer, lopti_config(**self.fields("batch", beta=0.04 * (trainer == "grpo"))))
        batch, eta = generation_batch_off_policy(generator)
        mask, old_probabilities = batch["completion_mask"].bool(), batch["old_per_token_logps"].exp()
        low_mask, weights = (old_probabilities < eta) & mask, 0.3 * old_probabilities + 0.7
        worst, failures, checked = {"isolation": 0.0, "ar": 0.0}, {}, []
        for configuration in configurations:
            fields = self.fields(f"{trainer}-loss", **configuration, advantage_reweighting_alpha=0.3)
            # the configs first: building one resets accelerate's state, which a trainer built before would need
            whole = lopti_config(**fields | {"lopti_threshold": None})
            plain = lopti_config(**fields | {"lopti_threshold": None, "advantage_reweighting_alpha": 0.0})
            lopti = self.trainer(lopti_trainer, lopti_config(**fields, lopti_threshold=eta))
            what = f"{trainer} {' '.join(map(str, configuration.values()))}".strip()
            try:
                unweighted = self.gradients(lopti, trl_trainer, batch, plain, kl=False)
            except ValueError as error:  # a loss type this TRL does not know
                if "loss type" in str(error).lower():
                    continue
                raise
            checked.append(configuration)
            with self.failure(failures, "isolation"):
                low, high = (self.gradients(lopti, trl_trainer, batch, lopti.args, index) for index in (0, 1))
                expected = self.gradients(lopti, trl_trainer, batch, whole)
                exactly_zero(expected[~mask], f"{what}: the whole loss's padding tokens", ("S6",))
                for group, gradient, active in (("low", low, low_mask), ("high", high, mask & ~low_mask)):
                    exactly_zero(gradient[~active], f"{what}: the {group} pass's inactive tokens")
                    difference = close(gradient[active], expected[active], self.tolerance, f"{what}: {group} pass")
                    worst["isolation"] = max(worst["isolation"], difference)
                difference = close(low + high, expected, self.tolerance, f"{what}: low + high")
                worst["isolation"] = max(worst["isolation"], difference)
            with self.failure(failures, "ar"):
                reweighted = self.gradients(lopti, trl_trainer, batch, whole, kl=False)
                exactly_zero(reweighted[unweighted == 0], f"{what}: AR where plain TRL has no gradient")
                worst["ar"] = max(worst["ar"], close(reweighted, weights * unweighted, self.tolerance, f"{what}: AR"))
        names = ", ".join(dict.fromkeys(c.get("loss_type", "rloo") for c in checked))
        count = f"{len(checked)} configurations ({names}; token, sequence)" if trainer == "grpo" else "its loss"
        return {
            "isolation": failures.get("isolation")
            or f"{count}: inactive tokens exactly 0, low + high = the whole to {worst['isolation']:.2g}",
            "ar": failures.get("ar") or f"{count}: each token's gradient = w(t) x plain TRL's to {worst['ar']:.2g}",
        }

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
        """The gradient of the trainer's loss with `args`, in pass `pass_index`, through each log-probability TRL's own
        forward returned (`kl=False`: without the KL term, at `beta` 0)."""
        values = dict(args=args, _step=pass_index * args.lopti_pass_micro_steps, beta=trainer.beta if kl else 0.0)
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        with temporarily_set(trainer, **values), observed_forwards(trl_class) as (_, kept):
            trainer.compute_loss(trainer.model, dict(batch)).backward()
        trainer.model.zero_grad(set_to_none=True)
        return kept[-1].grad

    def upgrade(self, trainer: str) -> str:
        trl_config, _, lopti_config, _ = classes(trainer)
        fields = self.fields("upgrade", learning_rate=3e-6, max_steps=6, temperature=0.7, beta=0.02, epsilon_high=0.3)
        upgraded = as_lopti_config(trl_config(**fields), self.model_path, lopti_config)  # (warnings: quiet)
        direct, names = lopti_config(**fields), [field.name for field in dataclasses.fields(lopti_config)]
        if differ := [name for name in names if repr(getattr(upgraded, name)) != repr(getattr(direct, name))]:
            raise Relation(f"fields that differ: {', '.join(differ)}")
        return f"{lopti_config.__name__} from a plain {trl_config.__name__}: {len(names)} fields equal"


def generation_batch_off_policy(trainer) -> tuple[dict[str, Any], float]:
    """A generation batch of `trainer` (its TRL keys, pi_old included) moved off-policy so that ratios clip on some
    tokens and sequences, with padding, and an eta half-way in the widest gap of its pi_old near the median."""
    trainer.model.train()
    rows = [{"prompt": p} for p in trainer.train_dataset["prompt"][:2] for _ in range(trainer.num_generations)]
    batch = {k: v for k, v in trainer._generate_and_score_completions(rows).items() if k not in LOPTI_BATCH_KEYS}
    old, advantages, mask = (batch[key].clone() for key in ("old_per_token_logps", "advantages", "completion_mask"))
    noise = torch.Generator().manual_seed(0)
    old += 0.3 * torch.randn(old.shape, generator=noise, dtype=torch.float64).to(old)
    old[0], old[-1] = old[0] + 0.5, old[-1] - 0.5  # two sequences whose ratios leave the clip range...
    advantages[0], advantages[-1] = -advantages[0].abs() - 0.1, advantages[-1].abs() + 0.1  # ...on their clipped side
    mask[1, -2:], mask[2, -1:] = 0, 0  # two completions end early: padding, which no loss may count (fact S6)
    batch.update(old_per_token_logps=old.clamp(max=-1e-6), advantages=advantages, completion_mask=mask)
    if batch.get("ref_per_token_logps") is not None:  # a reference unlike the policy: the KL term has a gradient
        ref = batch["ref_per_token_logps"]
        batch["ref_per_token_logps"] = ref + 0.3 * torch.randn(ref.shape, generator=noise, dtype=torch.float64).to(ref)
    batch["num_items_in_batch"] = mask.sum()
    if "old_logps" in batch:  # RLOO's: the masked sum
        batch["old_logps"] = (batch["old_per_token_logps"] * mask).sum(1)
    probabilities = torch.sort(batch["old_per_token_logps"].exp()[mask.bool()].double()).values
    middle = probabilities[len(probabilities) // 4 : max(len(probabilities) * 3 // 4, len(probabilities) // 4 + 2)]
    widest = int(torch.argmax(middle[1:] - middle[:-1]))
    return batch, float(middle[widest] + middle[widest + 1]) / 2


def default_device_and_precision(device: str | None, precision: str | None) -> tuple[str, str]:
    """`device` (default: CUDA where torch sees it, else the CPU) and `precision` (default: fp64 on CPU, else fp32)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, precision or ("fp64" if device == "cpu" else "fp32")


def run_checks(
    device: str | None = None, precision: str | None = None, trainers: tuple[str, ...] = ("grpo", "rloo"),
    report: Callable[[CheckResult], None] = lambda result: None,
) -> list[CheckResult]:  # fmt: skip
    """
    Runs every check of the contract for `trainers` on `device` in `precision` (`default_device_and_precision`;
    `"bf16"`: autocast over float32 weights); each result goes to `report` as soon as it is known. A check that fails,
    for any reason, fails alone: the others still run, and those that need its run say so, blaming no fact.
    """
    device, precision = default_device_and_precision(device, precision)
    results = []
    with tempfile.TemporaryDirectory(prefix="trl-lopti-check-") as folder, trl_contract.verifying_contract():
        with quiet():
            contract = Contract(Path(folder), device, precision)
        for trainer in trainers:
            losses, failed = {}, {}
            for check, (facts, needs) in CHECKS.items():
                result = CheckResult(f"{trainer} {check}", (*facts, *TRAINER_FACTS[trainer].get(check, ())), True, "")
                start = time.perf_counter()
                try:
                    if needs in failed:  # the check it needs said what broke
                        trl_fails = isinstance(failed[needs].error, TRLFails)
                        raise Relation(f"not run: {'TRL fails here' if trl_fails else 'it needs'} (the {needs} check)")
                    with quiet():
                        if check in ("isolation", "ar"):
                            losses = losses or contract.losses(trainer)
                        result.detail = losses[check] if check in losses else getattr(contract, check)(trainer)
                    if isinstance(result.detail, Relation):
                        raise result.detail
                except Exception as error:  # noqa: BLE001 - a verdict for every check, whatever breaks
                    named = tuple(re.findall(r"broke fact ([SGR]\d) of trl_lopti", str(error)))
                    result.broken = named or (error.facts if isinstance(error, Relation) else result.facts)
                    detail = str(error) if isinstance(error, Relation) else f"{type(error).__name__}: {error}"
                    result.passed, result.error, result.detail, failed[check] = False, error, detail[:600], result
                result.seconds = time.perf_counter() - start
                results.append(result)
                report(result)
    return results


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keeps what TRL, transformers and the trainers print (warnings, progress bars, completion tables, logs) out of
    the check's own lines."""
    verbosity, sink = logging.get_verbosity(), io.StringIO()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)


def write_verdict(results: list[CheckResult], device: str, precision: str, seconds: float) -> Path:
    """Caches the verdict of `results` for this stack (`trl_contract.verdict_path`), for the trainers' gate."""
    path, failed = trl_contract.verdict_path(), [result for result in results if not result.passed]
    broken = sorted({fact for result in failed for fact in result.broken})
    verdict = {"passed": not failed, "broken_facts": broken, "failed": [result.line() for result in failed]}
    verdict |= {
        "stack": trl_contract.stack_versions(),
        "device": device,
        "precision": precision,
        "seconds": round(seconds),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # its own: machines may share the cache
    partial.write_text(json.dumps(verdict, indent=1) + "\n")
    partial.replace(path)  # atomic: processes of other machines may read it
    return path


def main(argv: list[str]) -> int:
    """`trl-lopti check [--device D] [--precision P] [--trainers T ...]`: every check (or those of `--trainers`), each
    printed as it ends, then the verdict, cached for the trainers' gate when the whole contract ran; exit code 1 if a
    check fails."""
    parser = argparse.ArgumentParser(
        prog="trl-lopti check", description="trl_lopti's contract on this machine's stack"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where torch sees it, else cpu")
    parser.add_argument("--precision", choices=("fp64", "fp32", "bf16"), help="default: fp64 on cpu, fp32 on cuda")
    parser.add_argument("--trainers", nargs="+", choices=("grpo", "rloo"), default=["grpo", "rloo"])
    args = parser.parse_args(argv)
    # a process of its own, on a tiny model: one thread is fastest, and fast beside other work
    torch.set_num_threads(1)
    device, precision = default_device_and_precision(args.device, args.precision)
    print(
        f"trl-lopti check: {', '.join(f'{k} {v}' for k, v in trl_contract.stack_versions().items())}; {device}, {precision}"
    )
    start = time.perf_counter()
    results = run_checks(device, precision, tuple(args.trainers), report=lambda r: print(r.line(), flush=True))
    seconds, failed = time.perf_counter() - start, [result for result in results if not result.passed]
    whole = set(args.trainers) == {"grpo", "rloo"}  # the whole contract: the trainers' gate reads its verdict
    where = f"; verdict cached in {write_verdict(results, device, precision, seconds)}" if whole else ""
    if failed:
        broken = ", ".join(sorted({fact for result in failed for fact in result.broken})) or "none named"
        print(f"FAILED: {len(failed)} of {len(results)} checks in {seconds:.0f} s, broken facts {broken}{where}")
        return 1
    print(f"passed: {len(results)} of {len(results)} checks in {seconds:.0f} s{where}")
    return 0
