"""Parsing shared by the `trl-lopti` commands: TRL's `TrlParser.parse_args_and_config`, with errors that name the
config file or the field (a [`~trl_lopti.cli.errors.CliError`], exit code 2) instead of a traceback or a bare exit."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from trl import TrlParser

from .errors import CliError


class LoptiTrlParser(TrlParser):
    """
    [`~trl.TrlParser`] that raises instead of exiting on a bad argument (so that the caller can name the config file),
    refuses unknown config keys before any dataclass is built, and remembers which fields the config file set (what
    `--dry_run` reports under `training`).
    """

    config_fields: tuple[str, ...] = ()

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        remaining = super().set_defaults_with_config(**kwargs)
        if remaining:
            raise _UnknownFields(_unknown_fields_message([key.removeprefix("--") for key in remaining[::2]], self))
        self.config_fields = tuple(kwargs)
        return remaining

    def error(self, message: str):
        raise ValueError(message)


class _UnknownFields(CliError):
    """Keys of a config file that no dataclass of the parser has."""


def _unknown_fields_message(names: Sequence[str], parser: TrlParser) -> str:
    known = [action.dest for action in parser._actions if action.dest != "help"]
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown field(s) {', '.join(hints)}"


def parse_with_config(parser: LoptiTrlParser, argv: Sequence[str]) -> tuple:
    """
    `parser.parse_args_and_config(argv)` (TRL's: `--config FILE.yaml` supplies defaults, flags override them), with
    every error turned into a [`~trl_lopti.cli.errors.CliError`] that names the config file or the field.

    Args:
        parser ([`LoptiTrlParser`]):
            The parser.
        argv (`Sequence[str]`):
            The arguments.

    Returns:
        `tuple`: One instance per dataclass of the parser.
    """
    import yaml

    args = list(argv)
    config_path = None
    if "--config" in args:
        index = args.index("--config")
        if index + 1 >= len(args) or args[index + 1].startswith("--"):
            raise CliError("--config: expected a path to a YAML file after --config")
        config_path = args[index + 1]
    try:
        *parsed, unknown = parser.parse_args_and_config(args, return_remaining_strings=True)
    except _UnknownFields as error:
        raise CliError(f"{config_path}: {error}") from error
    except CliError:
        raise
    except FileNotFoundError as error:
        raise CliError(f"--config: config file {config_path!r} does not exist") from error
    except OSError as error:
        raise CliError(f"--config: cannot read {config_path}: {error}") from error
    except yaml.YAMLError as error:
        raise CliError(f"--config: {config_path} is not valid YAML: {error}") from error
    except ValueError as error:
        raise CliError(f"{error}" + (f" (config file {config_path})" if config_path else "")) from error
    if unknown:
        flags = [arg.removeprefix("--") for arg in unknown if arg.startswith("--")] or unknown
        raise CliError(f"command line: {_unknown_fields_message(flags, parser)}")
    return tuple(parsed)
