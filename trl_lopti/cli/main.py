"""The `trl-lopti` command line: argparse subcommands `train`, `demo` and `diagnose`, as TRL's own `trl` command.

```bash
trl-lopti train --config configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml   # like `trl grpo`, with AR and Lopti
trl-lopti demo                        # SmolLM2-135M-Instruct, offline, on CPU, with a before/after table
trl-lopti diagnose --help             # token-gradient diagnostics (see trl_lopti.diagnostics)
```

Each subcommand parses its own arguments (with TRL's `TrlParser`) in its module: `trl_lopti.cli.train`,
`trl_lopti.cli.demo`, `trl_lopti.cli.diagnose`, each with a `main(argv) -> int`.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from argparse import ArgumentParser
from collections.abc import Sequence

from .errors import CliError


COMMANDS = {
    "train": "train with GRPO + AR + Lopti from a YAML config and/or flags (like `trl grpo`)",
    "demo": "offline demo: SmolLM2-135M-Instruct trained on CPU, before/after table and curve",
    "diagnose": "measure per-token gradients by probability quartile (the paper's analysis)",
}
"""Subcommands: the module `trl_lopti.cli.<name>` runs each, with its help line."""


def make_parser() -> ArgumentParser:
    """
    Returns the top-level parser: `--version` and one subparser per command (each command parses its own options).

    Returns:
        `argparse.ArgumentParser`: The parser of `trl-lopti`.
    """
    from .. import __version__

    parser = ArgumentParser(
        prog="trl-lopti",
        allow_abbrev=False,
        description="Advantage Reweighting and Lopti (arXiv 2505.12929) for TRL's GRPOTrainer.",
        epilog="Run `trl-lopti COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"trl-lopti {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, help_text in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """
    Entry point of the `trl-lopti` console script and of `python -m trl_lopti`.

    Args:
        argv (`Sequence[str]`, *optional*):
            Arguments without the program name; defaults to `sys.argv[1:]`.

    Returns:
        `int`: The exit code (0 on success, 2 on a usage or configuration error).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    if argv[:1] == ["help"]:
        parser.print_help()
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"{parser.format_usage()}trl-lopti: error: unknown command {argv[0]!r}{hint}", file=sys.stderr)
        return 2
    try:
        args, _ = parser.parse_known_args(argv)
    except SystemExit as exit_:  # --help, --version, or argparse's own usage error
        return int(exit_.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    command_argv = argv[argv.index(args.command) + 1 :]
    try:
        return int(importlib.import_module(f".{args.command}", __package__).main(command_argv) or 0)
    except CliError as error:
        print(f"trl-lopti {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
