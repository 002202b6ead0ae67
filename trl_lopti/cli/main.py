"""`trl-lopti` (also `python -m trl_lopti`): Advantage Reweighting and Lopti (arXiv 2505.12929) for TRL's GRPO, RLOO.

commands (`trl-lopti COMMAND --help`: its options, parsed by TRL's `TrlParser`; a usage or config error exits with 2):
  train     train with GRPO (or RLOO: trainer: rloo) + AR + Lopti from a YAML config and/or flags, like `trl grpo`
  demo      the offline demo: SmolLM2-135M-Instruct trained on CPU, a before/after table and a curve
  diagnose  measure per-token gradients by probability quartile (the paper's analysis)
"""

import argparse
import importlib
import sys
from collections.abc import Sequence

from .. import __version__
from .parsing import CliError


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `trl_lopti.cli.<command>.main(args)` on `argv` (default `sys.argv[1:]`) and returns its exit code (2 on a
    usage or configuration error); `trl_lopti.__main__.run` is the console script and `python -m trl_lopti`."""
    formatter = argparse.RawTextHelpFormatter
    parser = argparse.ArgumentParser(prog="trl-lopti", description=__doc__, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"trl-lopti {__version__}")
    parser.add_argument("command", choices=("train", "demo", "diagnose"))
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # the commands, as `trl` alone lists its own
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
        return int(importlib.import_module(f".{args.command}", __package__).main(args.args) or 0)
    except CliError as error:
        print(f"trl-lopti {args.command}: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help, --version, or argparse's usage error (exit code 2, naming the flag)
        return int(exit_.code or 0)
