"""What every module of `trl_lopti.cli` shares: the table of commands, the user error and the nearest-name hint. It
imports nothing of `trl_lopti.cli`: the package's imports flow one way, from `main` through each command to here."""

import difflib
import importlib
import os
import sys
from collections.abc import Sequence


class CliError(ValueError):
    """A user error on the command line or in a config file: `trl-lopti` prints it without a traceback and exits 2."""


COMMANDS = {
    "grpo": (
        "train_command:grpo",
        "train LoptiGRPOTrainer: TRL's GRPO + AR + Lopti, from a preset, a YAML file and flags",
    ),
    "rloo": (
        "train_command:rloo",
        "train LoptiRLOOTrainer: TRL's RLOO + AR + Lopti, from a preset, a YAML file and flags",
    ),
    "presets": ("presets:main", "the presets and launchers installed with the package (--config NAME, --path NAME)"),
    "demo": ("demo:main", "the offline demo: SmolLM2-135M-Instruct trained on the CPU, a before/after table"),
    "diagnose": ("diagnose:main", "per-token gradients by probability quartile (the paper's analysis)"),
    "check": (
        ".check:main",
        "verify trl_lopti's contract with the installed TRL on this machine (10 to 20 s on a CPU)",
    ),
    # The name of `grpo` before 0.1.0, which says so; not listed.
    "train": ("train_command:train", None),
}
"""A command is a line here and a module: name -> (`module:function`, the module in `trl_lopti.cli` (`.check`:
`trl_lopti.check`), the function taking the arguments after the name and returning the exit code; what the command
does, None to list it not)."""


def nearest(name: str, names: Sequence[str]) -> str:
    """`"; did you mean X?"` for the one of `names` nearest to a misspelt `name`, or `""`.

    Args:
        name (`str`): the misspelt name.
        names (`Sequence[str]`): the real names.
    """
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.7)
    return f"; did you mean {close[0]}?" if close else ""


def import_class(dotted: str, option: str) -> type:
    """The class at `dotted` (`MODULE.CLASS`), imported with the current folder on the path, as `trl grpo` imports a
    reward function; a [`CliError`] in one line where it cannot be.

    Args:
        dotted (`str`): `MODULE.CLASS`, e.g. `my_trainers.LoptiGMPOTrainer`.
        option (`str`): the option that names it, for the error (`--trainer_class`).
    """
    module_name, _, class_name = dotted.rpartition(".")
    if not module_name:
        raise CliError(f"{option} {dotted}: give MODULE.CLASS, e.g. my_trainers.LoptiGMPOTrainer")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - whatever the user's module raises, one line
        said = (str(error).splitlines() or [""])[0]
        raise CliError(f"{option} {dotted}: importing {module_name} failed: {type(error).__name__}: {said}") from None
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        raise CliError(f"{option} {dotted}: {module_name} has no class {class_name}")
    return found
