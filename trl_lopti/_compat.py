"""The TRL releases trl_lopti supports, checked when the trainer or its config is first imported.

`trl_lopti.config` and the trainer modules import this module before they import TRL, so that an unsupported TRL fails
with the message below rather than somewhere inside TRL; `trl_lopti.tasks` does not import TRL at all.

The trainers rely on the TRL facts in `TRL_FACTS`, which hold unchanged from 1.10 to 1.16: `.ci/run` runs the contract,
exactness, schedule and split tests against the newest patch of each minor release.
TRL 1.15 is left out: its fused log-prob head needs Triton on every device (1.16 made it optional), so no test of
ours can run it on a CPU, and a release we cannot test is refused. A release above the range is refused too: the
runtime checks catch a changed loss forward, not a changed schedule, so a new release could train the wrong update.
"""

from __future__ import annotations

import os
import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version


SUPPORTED_TRL_SPEC = ">=1.10.0,<1.17,!=1.15.*"
"""The supported TRL releases, as `setup.cfg` declares them."""
SUPPORTED_TRL = SpecifierSet(SUPPORTED_TRL_SPEC)

TRL_FACTS = {
    "S1": "schedule: _prepare_inputs generates every steps_per_generation * self.num_iterations micro-steps (_step), "
    "buffers the micro-batches in _buffered_inputs and serves the same dicts until the next generation",
    "S2": "dataloader: the train sampler repeats each generation batch self.num_iterations * steps_per_generation "
    "times (read when built)",
    "S3": "loss forward: _compute_loss runs _get_per_token_logps_and_entropies once for the policy and differentiates "
    "its loss through the log-probabilities it returns",
    "S4": "checkpoints: _save_checkpoint, and _load_optimizer_and_scheduler on resume after self.state is loaded",
    "S5": "logging: log averages and clears self._metrics[mode], and reads self._logs for the completions table only "
    "while self.log_completions is true",
    "G1": "GRPO loss: reads advantages ((B, T) accepted) after its policy forward",
    "G2": "GRPO generation: returns old_per_token_logps whenever the policy moves before the batch is trained "
    "(deciding by self.num_iterations) or vLLM importance sampling needs it",
    "G3": "GRPO rewards: _calculate_rewards once per generation batch, every process's rewards in process order",
    "G4": "GRPO logs: the batch's advantages (every process) appended to self._logs['advantages']",
    "R1": "RLOO generation: pi_old is its first log-prob forward, kept only as the masked sum old_logps",
    "R2": "RLOO loss: sums its policy forward's log-probs over completion_mask, reads old_logps and advantages",
}
"""The TRL facts the trainers rely on, by number: S (both trainers; stated in `trl_lopti/lopti_mixin.py`), G
(`GRPOTrainer`; `trl_lopti/grpo_trainer.py`, `trl_lopti/reinforce_plus_plus.py`), R (`RLOOTrainer`;
`trl_lopti/rloo_trainer.py`). Each is checked while training ([`broken_fact`]) and pinned by
`tests/test_trl_contract.py`."""

TESTED_TRL_RELEASES = ("1.10.0", "1.11.0", "1.12.0", "1.13.0", "1.14.2", "1.16.0")
"""The newest patch of each supported minor release: what `.ci/run` tests."""

ALLOW_UNTESTED_TRL = "TRL_LOPTI_ALLOW_UNTESTED_TRL"
"""Set to 1 to import with a TRL outside the range anyway (with a warning), e.g. to run the contract tests on it."""

LIGER_MINIMUM_TRL = Version("1.14.0")
"""Below it, `use_liger_kernel=True` computes GRPO's loss in `compute_liger_loss`, which AR and Lopti cannot reach."""

_CONTRACT_TESTS = (
    "tests/test_trl_contract.py tests/test_exactness.py tests/test_schedule.py tests/test_lopti_split.py "
    "tests/test_rloo.py"
)


def unsupported_trl_message(installed: str) -> str:
    """What a user with TRL `installed` (outside `SUPPORTED_TRL`) is told: the range and what to do."""
    supported = f"trl_lopti supports TRL {SUPPORTED_TRL_SPEC} (tested: {', '.join(TESTED_TRL_RELEASES)})"
    if Version(installed) < Version("1.10.0"):
        return (
            f"{supported}, but TRL {installed} is installed: its GRPO losses differ from the ones trl_lopti is "
            f"exact for. Upgrade: pip install 'trl{SUPPORTED_TRL_SPEC}'"
        )
    untested = "this release was not tested"
    if installed.startswith("1.15."):
        untested = "its fused log-prob head needs Triton, so no CPU test runs it"
    return (
        f"{supported}, but TRL {installed} is installed: trl_lopti relies on GRPOTrainer and RLOOTrainer internals "
        f"(trl_lopti._compat.TRL_FACTS) and {untested}. Install a supported release (pip install "
        f"'trl{SUPPORTED_TRL_SPEC}'), or check this one: in a checkout of trl_lopti run {ALLOW_UNTESTED_TRL}=1 "
        f"python -m pytest {_CONTRACT_TESTS}; if they pass, {ALLOW_UNTESTED_TRL}=1 lets you train with it"
    )


def check_trl_version() -> str:
    """The installed TRL version; `ImportError` with a clear message when it is not a supported release."""
    try:
        installed = version("trl")
    except PackageNotFoundError as error:
        raise ImportError(f"trl_lopti needs TRL: pip install 'trl{SUPPORTED_TRL_SPEC}'") from error
    if Version(installed) in SUPPORTED_TRL:
        return installed
    if os.environ.get(ALLOW_UNTESTED_TRL) == "1":
        warnings.warn(
            unsupported_trl_message(installed) + f" ({ALLOW_UNTESTED_TRL}=1: importing anyway)", stacklevel=2
        )
        return installed
    raise ImportError(unsupported_trl_message(installed))


def broken_fact(number: str, saw: str) -> RuntimeError:
    """The error of a runtime check: the installed TRL no longer behaves as fact `number` of `TRL_FACTS` states, and
    `saw` says what the check saw. Training stops at the first step where it happens."""
    return RuntimeError(
        f"TRL {TRL_VERSION} broke fact {number} of trl_lopti ({TRL_FACTS[number]}): {saw}. Training stops here rather "
        "than train an update other than the method's (docs/releases.md)"
    )


def check_features(config) -> None:
    """Raises `ValueError` at the construction of `config` (a `GRPOConfig`) for a TRL option that the installed
    release runs outside the hooks AR and Lopti act through."""
    if config.use_liger_kernel and Version(TRL_VERSION) < LIGER_MINIMUM_TRL:
        raise ValueError(
            f"use_liger_kernel=True: with TRL {TRL_VERSION}, GRPOTrainer computes the Liger loss in compute_liger_loss, "
            "which never calls the log-prob forward that Advantage Reweighting and Lopti act through, so they would "
            f"be silently ignored. Set use_liger_kernel=False, or install TRL >= {LIGER_MINIMUM_TRL} (where the Liger "
            "loss goes through it)"
        )


TRL_VERSION = check_trl_version()
"""The installed TRL version (checked)."""
