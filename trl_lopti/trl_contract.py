"""
trl_lopti's contract with TRL: the facts about TRL's trainers that AR and Lopti rely on ([`TRLFact`],
`TRL_FACTS`), each with the wrong update its runtime check prevents and where it is checked (the checks sit
beside the hooks that rely on them, and raise [`broken_fact`]), and the gate of a TRL release outside
`TESTED_TRL_RELEASES` ([`require_verified_contract`]).

`tests/test_trl_contract.py` pins each fact on every tested release; `tests/test_fact_checks.py` breaks each
on purpose. The config and trainer modules import this module before TRL (it checks TRL's version);
`trl_lopti.tasks` never imports TRL.
"""

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


MINIMUM_TRL = "1.10.0"
"""The oldest TRL release `setup.cfg` admits (no upper bound): the oldest on which the contract holds."""

TESTED_TRL_RELEASES = ("1.10.0", "1.11.0", "1.12.0", "1.13.0", "1.14.2", "1.16.0")
"""The releases `.ci/run` tests (the newest patch of each minor release it passes on)."""

SKIP_CHECK_VARIABLE = "TRL_LOPTI_SKIP_CHECK"
"""Set to `1`, the trainers train on an untested release without `trl-lopti check`."""

RELEASES_PAGE = "the 'Supported releases' page of trl_lopti's documentation"


LAUNCHER_VARIABLES = re.compile(
    r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|MASTER_PORT|OMP_NUM_THREADS)$"
    r"|ACCELERATE_|TORCHELASTIC|OMPI_|PMI_|PMIX_|MV2_"
)
"""What a launcher sets in each process it starts: not passed on to the check's own process."""


@dataclasses.dataclass(frozen=True)
class TRLFact:
    """
    A fact about TRL's trainers that trl_lopti relies on.

    Args:
        code (`str`):
            Its number: `S` for both trainers, `G` for `GRPOTrainer`, `R` for `RLOOTrainer`.
        name (`str`):
            A few words that name it.
        statement (`str`):
            What TRL does.
        prevents (`str`):
            The wrong update that its runtime check prevents.
        checked_by (`str`):
            Where trl_lopti checks it while training.
        methods (`tuple[str, ...]`):
            The trainer methods whose behaviour it states: where one of them is a user's override, the user's
            class broke it, not TRL.
        checked_while_training (`bool`):
            Whether a runtime check stops a training run that breaks it; else only `trl-lopti check` finds it.
    """

    code: str
    name: str
    statement: str
    prevents: str
    checked_by: str
    methods: tuple[str, ...]
    checked_while_training: bool = True


SCHEDULE = TRLFact(
    "S1",
    "Schedule",
    "`_prepare_inputs` generates only when `self._step % (steps_per_generation * self.num_iterations) == 0` (or with "
    "nothing buffered), buffers the batch split into micro-batches in `self._buffered_inputs` (every tensor of the batch "
    "split by rows, a 0-dim one copied) and serves slice `self._step % steps_per_generation` until the next generation; "
    "its train sampler repeats each generation batch `self.num_iterations * steps_per_generation` times",
    "a pass over other completions than the generation batch that was split, or a run that leaves the prompts served "
    "inside a cycle untrained",
    "`lopti_mixin.check_generation_step`, at every generation; `lopti_mixin.check_split_carried`, at every loss; "
    "`lopti_mixin.check_prompts`, at every micro-step",
    ("_prepare_inputs", "_get_train_sampler", "get_train_dataloader", "training_step"),
)
LOSS_FORWARD = TRLFact(
    "S2",
    "Loss forward",
    "`_compute_loss(model, inputs)` calls `self._get_per_token_logps_and_entropies` on the model it received, with "
    "gradient, which returns (log-probabilities, entropies, auxiliary loss), and is differentiated through those "
    "log-probabilities",
    "an update whose gradient bypasses the log-probabilities that AR and Lopti act on",
    "`lopti_mixin.check_forward_output`, `lopti_mixin.check_policy_forward`, at every training loss",
    ("compute_loss", "_compute_loss", "_get_per_token_logps_and_entropies"),
)
CHECKPOINTS = TRLFact(
    "S3",
    "Checkpoints",
    "`_save_checkpoint` and `_load_optimizer_and_scheduler` are the extension points for trainer state, and "
    "transformers calls the latter on resume after `self.state` is loaded",
    "a resumed run that trains the wrong pass of its generation batch, or a new batch in the middle of a cycle",
    "`lopti_mixin.check_resumed_state`, `lopti_mixin.check_step_counter`, on resume and at every micro-step",
    ("_save_checkpoint", "_load_optimizer_and_scheduler"),
)
LOSS_MASK = TRLFact(
    "S4",
    "Loss mask",
    "every loss sums its per-token terms over `completion_mask` (times `tool_mask` where the batch has one)",
    "gradient through tokens that belong to neither Lopti group (padding, tool output), so that the two passes do not "
    "add up to the whole update",
    "`lopti_mixin.check_loss_mask`, before every optimizer step, summed over every process",
    ("compute_loss", "_compute_loss"),
)
GRPO_LOSS = TRLFact(
    "G1",
    "GRPO loss",
    "`_compute_loss` accepts token-level advantages (B, T) in `inputs['advantages']` and weights each token's term by "
    "its own",
    "an update with other advantages than AR's token-level ones (with a KL term in TRL's own loss)",
    "`check.Contract.losses`, the AR relation of `trl-lopti check` (the gate of an untested release): a loss that "
    "reads the advantages otherwise keeps every shape a check while training could see",
    ("compute_loss", "_compute_loss"),
    checked_while_training=False,
)
GRPO_GENERATION = TRLFact(
    "G2",
    "GRPO generation",
    "`_generate_and_score_completions` returns `old_per_token_logps` whenever `gradient_accumulation_steps % "
    "(steps_per_generation * self.num_iterations) != 0`: the policy moves between the batch's generation and its "
    "training, as it always does under Lopti, whose passes `self.num_iterations` counts",
    "a split, AR weights and second-pass ratios against a policy that already moved, taken for pi_old",
    "`grpo_trainer.LoptiGRPOTrainer.old_per_token_logps_at_generation`, at every generation batch",
    ("_generate_and_score_completions",),
)
GRPO_REWARDS = TRLFact(
    "G3",
    "GRPO rewards",
    "`_generate_and_score_completions` calls `self._calculate_rewards` once per generation batch, which returns the "
    "rewards of every completion of the batch (all processes, in process order), a column per reward function",
    "REINFORCE++ advantages whitened over the rewards of other completions",
    "`reinforce_plus_plus.ReinforcePlusPlusMixin._generate_and_score_completions`, at every generation batch",
    ("_generate_and_score_completions", "_calculate_rewards"),
)
RLOO_GENERATION = TRLFact(
    "R1",
    "RLOO generation",
    "`_generate_and_score_completions` computes pi_old with its first `_get_per_token_logps_and_entropies` call (the "
    "policy, without gradient, before the reference model's) and returns its masked sum as `old_logps`",
    "a split and AR weights from other log-probabilities than pi_old (the reference model's)",
    "`rloo_trainer.LoptiRLOOTrainer.old_per_token_logps_at_generation`, at every generation batch",
    ("_generate_and_score_completions",),
)
RLOO_LOSS = TRLFact(
    "R2",
    "RLOO loss",
    "`_compute_loss` sums the log-probabilities of its one policy forward over `completion_mask` (no `tool_mask`)",
    "a split over a `tool_mask` that RLOO's loss ignores, so that the two passes do not cover the tokens it trains",
    "`rloo_trainer.LoptiRLOOTrainer.old_per_token_logps_at_generation`, at every generation batch",
    ("_generate_and_score_completions", "compute_loss", "_compute_loss"),
)
TRL_FACTS = (
    SCHEDULE,
    LOSS_FORWARD,
    CHECKPOINTS,
    LOSS_MASK,
    GRPO_LOSS,
    GRPO_GENERATION,
    GRPO_REWARDS,
    RLOO_GENERATION,
    RLOO_LOSS,
)
"""Every fact, in order: those of both trainers, then GRPO's, then RLOO's."""


def broken_fact(fact: TRLFact, saw: str, trainer_class: type) -> RuntimeError:
    """
    The error of a runtime check: a trainer of `trainer_class` no longer behaves as `fact` says, and `saw` says
    what it saw.

    The fact's methods tell who broke it. Where one of them comes from a class outside the TRL trainer that
    trl_lopti extends and its bases (a user's override, or another trainer of TRL's such as `GMPOTrainer`, which
    trl_lopti's tested releases do not cover), the error names that class and method, and `trl-lopti check
    --trainer_class`. Else TRL (or transformers, where every such method is its `Trainer`'s) broke it: a TRL
    release to install is advised only where the installed one is untested, never the release installed.

    Args:
        fact (`TRLFact`):
            The fact.
        saw (`str`):
            What the check saw.
        trainer_class (`type`):
            The trainer's class: trl_lopti's, or a user's composition.
    """
    from .utils import base_trainer_class, defining_class

    trl_trainer_class = getattr(trainer_class, "trl_trainer_class", trainer_class)
    owners = {name: defining_class(trainer_class, name) for name in fact.methods}
    owners = {name: owner for name, owner in owners.items() if owner is not None}
    composed = {name: owner for name, owner in owners.items() if owner not in trl_trainer_class.__mro__}
    stops = f"Training stops here rather than train {fact.prevents}"
    if composed:
        methods = [f"{owner.__name__}.{name}" for name, owner in composed.items()]
        modules = sorted({owner.__module__ for owner in composed.values()})
        base = base_trainer_class(trainer_class, trl_trainer_class)
        return RuntimeError(
            f"{', '.join(methods)} (in {', '.join(modules)}) breaks fact {fact.code} of trl_lopti ({fact.name}): "
            f"{saw}. {stops}. trl_lopti relies on this: {fact.statement}. Change {' or '.join(methods)} so that it "
            f"holds, or train {base.__name__} without trl_lopti; {check_trainer_class_command(trainer_class)} shows "
            "which relation fails"
        )
    roots = {owner.__module__.split(".")[0] for owner in owners.values()}
    library = "TRL" if "trl" in roots else "transformers"
    installed = TRL_VERSION if library == "TRL" else version("transformers")
    changed = " or ".join(f"{owner.__name__}.{name}" for name, owner in owners.items())
    if library == "TRL" and TRL_VERSION not in TESTED_TRL_RELEASES:
        advice = f"Install a tested release (pip install 'trl=={TESTED_TRL_RELEASES[-1]}')"
    elif library == "TRL":
        advice = (
            f"TRL {TRL_VERSION} is a tested release, so something on this machine changed {changed} (a patch applied "
            "at run time, an edited install): train without that change"
        )
    else:
        advice = (
            f"Something changed {changed}: a transformers release outside the tested stacks, or a patch applied at "
            "run time. Install a transformers release of the tested stacks"
        )
    return RuntimeError(
        f"{library} {installed} broke fact {fact.code} of trl_lopti ({fact.name}): {saw}. {stops}. {advice}; "
        f"`trl-lopti check` shows every fact on this machine, and {RELEASES_PAGE} lists them"
    )


def check_trainer_class_command(trainer_class: type) -> str:
    """How to run `trl-lopti check` on a user's trainer class: by its dotted path, or from Python where it is
    defined in a script."""
    if trainer_class.__module__ == "__main__":
        return f"`trl_lopti.check.check_trainer_class({trainer_class.__qualname__})` in your script"
    return f"`trl-lopti check --trainer_class {trainer_class.__module__}.{trainer_class.__qualname__}`"


# ------------------------------------------------------------------------------------------------ the gate
def verdict_key(trainer: str, device_type: str, precision: str) -> dict[str, str]:
    """
    What a verdict of `trl-lopti check` holds for; a verdict made for another key is never used.

    Args:
        trainer (`str`):
            `"grpo"` or `"rloo"`.
        device_type (`str`):
            `"cpu"`, or an accelerator's device type (`"cuda"`): the key holds its first device's name.
        precision (`str`):
            `"fp64"`, `"fp32"`, `"bf16"` or `"fp16"`.
    """
    import torch

    key = {package: version(package) for package in ("trl", "transformers", "torch", "accelerate", "trl_lopti")}
    # Every module of trl_lopti, its subpackages' included: an edited checkout is another stack.
    package = Path(__file__).parent
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(str(path.relative_to(package)).encode() + path.read_bytes())
    key["trl_lopti_source"] = source.hexdigest()[:16]
    key["trainer"] = trainer
    key["device"] = device_type
    # An accelerator's first device by name, where its module names devices (MPS's does not).
    if device_type != "cpu":
        get_device_name = getattr(torch.get_device_module(device_type), "get_device_name", None)
        if get_device_name is not None:
            key["device"] += f" ({get_device_name(0)})"
    key["precision"] = precision
    return key


def verdict_folder() -> Path:
    """The folder of the cached verdicts, in the Hugging Face cache folder (`HF_HOME`, else its default)."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.environ.get("HF_HOME") or default).expanduser() / "trl_lopti" / "contract"


def verdict_path(key: dict[str, str]) -> Path:
    """The file of the verdict of `key`: its trainer and a digest of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return verdict_folder() / f"{key['trainer']}-{digest}.json"


def read_verdict(key: dict[str, str]) -> dict[str, Any] | None:
    """The cached verdict of `key`, `None` where there is none."""
    try:
        verdict = json.loads(verdict_path(key).read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and verdict.get("key") == key else None


def write_verdict(verdict: dict[str, Any]) -> dict[str, Any]:
    """Caches a verdict that passed or found a fact broken, never an inconclusive one; returns it with
    `cached_in` (the file) or, where the cache cannot be written, `cache_error`."""
    if verdict["outcome"] == "inconclusive":
        return verdict
    path = verdict_path(verdict["key"])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A file of this writer's own, then an atomic rename: processes of other machines may read the cache.
        descriptor, partial = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        with os.fdopen(descriptor, "w") as file:
            file.write(json.dumps(verdict, indent=1) + "\n")
        os.replace(partial, path)
    except OSError as error:
        return {**verdict, "cache_error": f"{verdict_folder()}: {error}"}
    return {**verdict, "cached_in": str(path)}


_verifying_contract = False
"""True while `trl-lopti check` runs its own trainers, which the gate lets train."""

_verdicts_of_this_process: dict[str, dict[str, Any]] = {}
"""The conclusive verdicts this process obtained, by key: they hold for the process where the cache cannot
keep them."""

_warned_skip = False


def check_command(key: dict[str, str], device_type: str) -> str:
    """The `trl-lopti check` command that gives the verdict of `key`."""
    return f"trl-lopti check --trainers {key['trainer']} --device {device_type} --precision {key['precision']}"


def run_check(key: dict[str, str], device_type: str) -> dict[str, Any]:
    """The verdict of `key` by `trl-lopti check`, run in a process of its own without the launcher's
    settings."""
    command = check_command(key, device_type)
    sys.stderr.write(f"trl_lopti: TRL {TRL_VERSION} is untested: checking trl_lopti's contract once: {command}\n")
    environment = {name: value for name, value in os.environ.items() if not LAUNCHER_VARIABLES.match(name)}
    with tempfile.TemporaryDirectory(prefix="trl-lopti-gate-") as folder:
        verdict_file = Path(folder) / "verdict.json"
        arguments = [sys.executable, "-m", "trl_lopti", *command.split()[1:], "--verdict_file", str(verdict_file)]
        completed = subprocess.run(arguments, env=environment, check=False)
        try:
            return json.loads(verdict_file.read_text())
        except (OSError, ValueError):
            reason = f"it ended with exit code {completed.returncode} before a verdict (its output above says why)"
            return {"key": key, "outcome": "inconclusive", "reason": reason}


def require_verified_contract(trainer: str, args) -> None:
    """
    The gate of an untested TRL release: a Lopti trainer trains once `trl-lopti check` has passed on this
    machine for its trainer and stack ([`verdict_key`]).

    Where no verdict is cached, the first process of each machine runs the check once, while every other process of
    every machine waits (for at most TRL's `ddp_timeout`). The run then trains only where every machine's verdict
    passed, and refuses on every process otherwise, so that no process waits for the others in vain.
    `TRL_LOPTI_SKIP_CHECK=1`, set for every process, trains without the check.

    Args:
        trainer (`str`):
            `"grpo"` or `"rloo"`.
        args (`TrainingArguments`):
            The run's arguments: its device and precision.
    """
    global _warned_skip
    if TRL_VERSION in TESTED_TRL_RELEASES or _verifying_contract:
        return
    from accelerate import PartialState

    state = PartialState()
    skip = os.environ.get(SKIP_CHECK_VARIABLE) == "1"
    device_type = args.device.type
    # The precision of the run is its mixed precision.
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    key = verdict_key(trainer, device_type, precision)
    name = json.dumps(key, sort_keys=True)
    verdict = _verdicts_of_this_process.get(name) or read_verdict(key)
    if verdict is None and not skip and state.is_local_main_process:
        verdict = run_check(key, device_type)
        if "cache_error" in verdict:
            warnings.warn(
                f"trl_lopti: the verdict of `trl-lopti check` holds for this process only: it could not be cached "
                f"({verdict['cache_error']}). Set HF_HOME to a writable folder to keep it for later runs.",
                UserWarning,
                stacklevel=3,
            )
    if verdict is not None and verdict["outcome"] != "inconclusive":
        _verdicts_of_this_process[name] = verdict
    # Every process of every machine meets here, and learns whether every process skips and what the first
    # process of each machine found.
    everyone = [{"skip": skip, "verdict": verdict, "first": state.is_local_main_process}]
    if state.num_processes > 1:
        import torch.distributed

        everyone = [None] * state.num_processes
        torch.distributed.all_gather_object(
            everyone, {"skip": skip, "verdict": verdict, "first": state.is_local_main_process}
        )
    skips = [entry["skip"] for entry in everyone]
    if all(skips):
        if not _warned_skip:
            _warned_skip = True
            warnings.warn(
                f"{SKIP_CHECK_VARIABLE}=1: trl_lopti's trainers train on TRL {TRL_VERSION}, which trl_lopti has not "
                "tested, without `trl-lopti check`. The runtime checks of the TRL facts still stop a run at the first "
                "step where TRL breaks one; what only the check proves, that each update is the method's against "
                "TRL's own trainer, is not proven on this stack.",
                UserWarning,
                stacklevel=3,
            )
        return
    if any(skips):
        raise RuntimeError(
            f"{SKIP_CHECK_VARIABLE}=1 is set for {sum(skips)} of the run's {len(skips)} processes: set it for every "
            "process of every machine, or for none"
        )
    trainer_name = f"Lopti{trainer.upper()}Trainer"
    own = everyone[state.process_index - state.local_process_index]["verdict"]
    if own["outcome"] != "passed":
        raise RuntimeError(refusal(own, trainer_name, check_command(key, device_type)))
    for entry in everyone:
        if entry["first"] and entry["verdict"]["outcome"] != "passed":
            message = refusal(entry["verdict"], trainer_name, check_command(key, device_type))
            raise RuntimeError(f"Another machine of this run refuses to train. There: {message}")


def refusal(verdict: dict[str, Any], trainer_name: str, command: str) -> str:
    """Why `trainer_name` does not train: the verdict of `command` failed or was inconclusive."""
    stack = f"{verdict['key']['device']}, {verdict['key']['precision']}"
    install = f"install a tested release: pip install 'trl=={TESTED_TRL_RELEASES[-1]}' ({RELEASES_PAGE} lists them)"
    if verdict["outcome"] == "failed":
        facts = {fact.code: fact for fact in TRL_FACTS}
        broken = "; ".join(f"{code} ({facts[code].name})" for code in verdict["broken_facts"])
        where = "this process" if "cache_error" in verdict else verdict_path(verdict["key"])
        return (
            f"TRL {TRL_VERSION} breaks trl_lopti's contract for {trainer_name} on this machine ({stack}): broken "
            f"facts {broken}. `{command}` found:\n" + "\n".join(verdict["failed_checks"]) + f"\nThe verdict is kept "
            f"in {where}: runs on this stack are refused without checking again (`{command}` checks again and "
            f"replaces it). To train, {install}."
        )
    return (
        f"TRL {TRL_VERSION} is untested, and `{command}` could not confirm that trl_lopti's contract holds for "
        f"{trainer_name} on this machine ({stack}): {verdict['reason']}. Nothing was cached: the next run checks "
        f"again. To train anyway, without the check, set {SKIP_CHECK_VARIABLE}=1 (the runtime checks of the TRL facts "
        f"still stop a run where one breaks), or {install}."
    )


def check_trl_version() -> str:
    """The installed TRL version; a warning naming it where it is not among `TESTED_TRL_RELEASES`."""
    try:
        installed = version("trl")
    except PackageNotFoundError as error:
        raise ImportError(f"trl_lopti needs TRL: pip install 'trl>={MINIMUM_TRL}'") from error
    if installed not in TESTED_TRL_RELEASES:
        warnings.warn(
            f"trl_lopti was tested with TRL {', '.join(TESTED_TRL_RELEASES)}, not with the installed TRL {installed}: "
            "its trainers train once `trl-lopti check` has passed on this machine for the trainer, device and "
            "precision of the run (the first run checks, 10 to 20 seconds on a CPU, and caches the verdict). "
            f"{SKIP_CHECK_VARIABLE}=1 trains without the check; {RELEASES_PAGE} says more.",
            UserWarning,
            stacklevel=2,
        )
    return installed


TRL_VERSION = check_trl_version()
"""The installed TRL version."""
