"""`trl-lopti` (also `python -m trl_lopti`): Advantage Reweighting and Lopti (arXiv 2505.12929) for TRL's GRPO and
RLOO trainers. `trl-lopti COMMAND --help`: a command's options; a usage or config error exits with 2."""

import importlib
import sys
from collections.abc import Sequence

from .. import __version__
from .base import COMMANDS, CliError, nearest


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command `argv[0]` and returns its exit code; alone, lists the commands. `trl_lopti.__main__.run` is the
    console script and `python -m trl_lopti`.

    Args:
        argv (`Sequence[str]`, *optional*): the command and its arguments; default `sys.argv[1:]`.
    """
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
    except SystemExit as exit_:
        # --help, or argparse's usage error of a command that parses with argparse alone.
        return int(exit_.code or 0)
