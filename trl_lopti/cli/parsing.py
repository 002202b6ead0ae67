"""Parsing shared by the `trl-lopti` commands. TRL's parser reads `None`, `none` and `null` as `None` for every
`float | None` and `int | None` field (`--lopti_threshold None`); a bad flag is argparse's usage error (exit code 2).
"""

from collections.abc import Sequence
from pathlib import Path

from .errors import CliError


def parse_with_config(parser, argv: Sequence[str]) -> tuple:
    """`parser.parse_args_and_config(argv)` (`--config FILE.yaml` supplies defaults, flags override them): one instance
    per dataclass. A config file that is missing, not YAML, not a mapping or holds an unknown key, and a value a
    dataclass rejects, raise a [`~trl_lopti.cli.errors.CliError`] that names the file."""
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
    """Returns `model_name_or_path` (a hub id or a local folder) once checked, before anything loads: it must be set,
    and be a folder when it reads as a local path."""
    if not model_name_or_path:
        raise CliError("model_name_or_path: required (a model folder or a hub id such as Qwen/Qwen2.5-3B-Instruct)")
    if model_name_or_path.startswith(("/", ".", "~")) and not Path(model_name_or_path).expanduser().is_dir():
        raise CliError(f"model_name_or_path: {model_name_or_path!r} is not a folder")
    return model_name_or_path
