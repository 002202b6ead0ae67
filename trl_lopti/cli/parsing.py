"""Parsing shared by the `trl-lopti` commands: TRL's `TrlParser.parse_args_and_config`, its errors turned into a
[`~trl_lopti.cli.errors.CliError`] that names the config file (exit code 2), and the check of `model_name_or_path`.

TRL's parser reads `None`, `none` and `null` as `None` for every `float | None` and `int | None` field, so
`--lopti_threshold None` disables Lopti from the command line as `lopti_threshold: null` does in YAML. A bad value or
an unknown flag on the command line is argparse's usage error, which names the flag (exit code 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .errors import CliError


def parse_with_config(parser, argv: Sequence[str]) -> tuple:
    """
    `parser.parse_args_and_config(argv)`: `--config FILE.yaml` supplies defaults, flags override them. A config file
    that is missing, not YAML, not a mapping or holds an unknown key, and a value a dataclass rejects, raise a
    [`~trl_lopti.cli.errors.CliError`] that names the file.

    Args:
        parser ([`~trl.TrlParser`]):
            The parser.
        argv (`Sequence[str]`):
            The arguments.

    Returns:
        `tuple`: One instance per dataclass of the parser.
    """
    import yaml

    args = list(argv)
    if args[-1:] == ["--config"]:
        raise CliError("--config: expected the path of a YAML file")
    config = args[args.index("--config") + 1] if "--config" in args else None
    try:
        return tuple(parser.parse_args_and_config(args))
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise CliError(f"{error}" + (f" (config file {config})" if config else "")) from error


def check_model_name_or_path(model_name_or_path: str | None) -> str:
    """
    Checks `model_name_or_path` before anything loads: it must be set, and be a folder when it reads as a local path.

    Args:
        model_name_or_path (`str` or `None`):
            `ModelConfig.model_name_or_path`: a hub id or a local model folder.

    Returns:
        `str`: `model_name_or_path`.
    """
    if not model_name_or_path:
        raise CliError("model_name_or_path: required (a model folder or a hub id such as Qwen/Qwen2.5-3B-Instruct)")
    if model_name_or_path.startswith(("/", ".", "~")) and not Path(model_name_or_path).expanduser().is_dir():
        raise CliError(f"model_name_or_path: {model_name_or_path!r} is not a folder")
    return model_name_or_path
