"""`trl-lopti` (also `python -m trl_lopti`): Advantage Reweighting and Lopti (arXiv 2505.12929) for TRL's GRPO and
RLOO trainers. `trl-lopti COMMAND --help`: a command's options; a usage or config error exits with 2."""

import difflib
import importlib
import sys
from collections.abc import Sequence

from .. import __version__


class CliError(ValueError):
    """A user error on the command line or in a config file: `trl-lopti` prints it, without a traceback, and exits 2."""


COMMANDS = {
    "grpo": ("train:grpo", "train LoptiGRPOTrainer: TRL's GRPO + AR + Lopti, from a preset, a YAML file and flags"),
    "rloo": ("train:rloo", "train LoptiRLOOTrainer: TRL's RLOO + AR + Lopti, from a preset, a YAML file and flags"),
    "presets": ("presets:main", "the presets installed with the package (--config NAME), one line each"),
    "demo": ("demo:main", "the offline demo: SmolLM2-135M-Instruct trained on the CPU, a before/after table"),
    "diagnose": ("diagnose:main", "per-token gradients by probability quartile (the paper's analysis)"),
    "check": (".check:main", "verify trl_lopti's contract with the installed TRL on this machine (about 10 s)"),
    "train": ("train:train", None),  # the name of `grpo` before 0.1.0, which says so (not listed)
}
"""A command is a line here and a module: name -> (`module:function`, the module in `trl_lopti.cli` (`.check`:
`trl_lopti.check`), the function taking the arguments after the name and returning the exit code; what the command
does, None to list it not)."""


def nearest(name: str, names: Sequence[str]) -> str:
    """`"; did you mean X?"` for the one of `names` nearest to a misspelt `name`, or `""`."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.7)
    return f"; did you mean {close[0]}?" if close else ""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command `argv[0]` (default `sys.argv[1:]`) and returns its exit code; alone, lists the commands.
    `trl_lopti.__main__.run` is the console script and `python -m trl_lopti`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    listed = [name for name, (_, purpose) in COMMANDS.items() if purpose]
    if argv[:1] in ([], ["-h"], ["--help"]):
        print(f"usage: trl-lopti COMMAND [--config FILE|PRESET] [--FIELD VALUE ...]\n\n{__doc__}\n\ncommands:")
        print("\n".join(f"  {name:<9} {COMMANDS[name][1]}" for name in listed))
        return 0
    if argv[0] == "--version":
        print(f"trl-lopti {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        error = f"no command {argv[0]!r}{nearest(argv[0], listed)} (commands: {', '.join(listed)})"
        print(f"trl-lopti: error: {error}", file=sys.stderr)
        return 2
    module, function = COMMANDS[argv[0]][0].split(":")
    try:
        return int(getattr(importlib.import_module(f".{module}", __package__), function)(argv[1:]) or 0)
    except CliError as error:
        print(f"trl-lopti {argv[0]}: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help, or argparse's usage error of a command that parses with argparse alone
        return int(exit_.code or 0)
