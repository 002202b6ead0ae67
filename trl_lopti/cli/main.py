"""`trl-lopti` (also `python -m trl_lopti`): Advantage Reweighting and Lopti (arXiv 2505.12929) for TRL's
GRPOTrainer. Each command parses its arguments with TRL's `TrlParser` and exits with code 2 on a usage or
configuration error.

commands:
  train     train with GRPO + AR + Lopti from a YAML config and/or flags, like `trl grpo`
  demo      the offline demo: SmolLM2-135M-Instruct trained on CPU, a before/after table and a curve
  diagnose  measure per-token gradients by probability quartile (the paper's analysis)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .errors import CliError


COMMANDS = ("train", "demo", "diagnose")
"""The commands: the module `trl_lopti.cli.<name>` runs each with its `main(argv) -> int`."""


def main(argv: Sequence[str] | None = None) -> int:
    """
    Entry point of the `trl-lopti` console script and of `python -m trl_lopti`.

    Args:
        argv (`Sequence[str]`, *optional*):
            Arguments without the program name; defaults to `sys.argv[1:]`.

    Returns:
        `int`: The exit code (0 on success, 2 on a usage or configuration error).
    """
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="trl-lopti", description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
        epilog="Run `trl-lopti COMMAND --help` for the options of a command.",
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"trl-lopti {__version__}")
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
        return int(importlib.import_module(f".{args.command}", __package__).main(args.args) or 0)
    except CliError as error:
        print(f"trl-lopti {args.command}: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help, --version, or argparse's usage error (exit code 2, naming the flag)
        return int(exit_.code or 0)


if __name__ == "__main__":
    sys.exit(main())
