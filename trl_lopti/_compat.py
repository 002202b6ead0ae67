"""The TRL versions this package is tested against, checked when the trainer or its config is first imported.

`trl_lopti.config` and `trl_lopti.trainer` import this module before they import TRL, so that an untested TRL fails
with the message below rather than somewhere inside TRL; `trl_lopti.tasks` does not import TRL at all.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version


# The trainer relies on TRL internals (see the module docstring of `trl_lopti.trainer`): widen this range only after
# `pytest tests/test_trl_contract.py` passes on the new version.
TESTED_TRL_RANGE = (Version("1.16.0"), Version("1.17.0"))


def check_trl_version() -> str:
    """
    Raises `ImportError` with a clear message when the installed TRL is outside the tested range.

    Returns:
        `str`: The installed TRL version.
    """
    try:
        installed = version("trl")
    except PackageNotFoundError as error:
        raise ImportError("trl_lopti needs TRL: pip install 'trl>=1.16.0,<1.17'") from error
    low, high = TESTED_TRL_RANGE
    if not low <= Version(installed) < high:
        raise ImportError(
            f"trl_lopti is tested with TRL >={low},<{high} but TRL {installed} is installed; it relies "
            f"on GRPOTrainer internals that change between versions. Install a tested version: "
            f"pip install 'trl>={low},<{high}'"
        )
    return installed


TRL_VERSION = check_trl_version()
"""The installed TRL version (checked)."""
