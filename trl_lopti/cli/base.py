"""What every module of `trl_lopti.cli` shares: the table of commands, the user error and the nearest-name hint. It
imports nothing of `trl_lopti.cli`: the package's imports flow one way, from `main` through each command to here."""

import difflib
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
