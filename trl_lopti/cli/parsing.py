"""Parsing shared by the `trl-lopti` commands, and their error type. TRL's parser reads `None`, `none` and `null` as
`None` for every `float | None` and `int | None` field (`--lopti_threshold None`); a bad flag is argparse's usage error
(exit code 2).
"""

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


class CliError(ValueError):
    """A user error on the command line or in a config file: `trl-lopti` prints it, without a traceback, and exits 2."""


def parse_with_config(parser, argv: Sequence[str]) -> tuple:
    """`parser.parse_args_and_config(argv)` (`--config FILE.yaml` supplies defaults, flags override them): one instance
    per dataclass. A config file that is missing, not YAML, not a mapping or holds an unknown key, and a value a
    dataclass rejects, raise a [`CliError`] that names the file; where transformers refuses a machine without an
    accelerator, the error names the flag that trains on the CPU."""
    import yaml

    args = list(argv)
    if args[-1:] == ["--config"]:
        raise CliError("--config: expected the path of a YAML file")
    config = args[args.index("--config") + 1] if "--config" in args else None
    try:
        return tuple(parser.parse_args_and_config(args))
    except (OSError, ValueError, yaml.YAMLError) as error:
        message = f"{error}" + (f" (config file {config})" if config else "")
        if "use_cpu" in message and not torch.accelerator.is_available():  # transformers' check of bf16 against GPUs
            message += "; this machine has no accelerator: add --use_cpu true to run on its CPU"
        raise CliError(message) from error


def on_cpu(argv: Sequence[str], command: str, settings: dict[str, Any] | None = None) -> list[str]:
    """`argv` for a side tool (`demo`, `diagnose`, `train --rehearse`, `train --dry_run`) on a machine without an
    accelerator (`torch.accelerator`), where TRL's default bf16 would refuse to start: the CPU settings (`settings`,
    default `use_cpu=True`) that `argv` does not set itself are added as flags, and one line says so."""
    given = {arg.split("=")[0] for arg in argv}
    added = {name: value for name, value in (settings or {"use_cpu": True}).items() if f"--{name}" not in given}
    flags = [f"--{name}={value}" for name, value in added.items()]
    if flags and os.environ.get("RANK", "0") == "0":  # once under a launcher
        print(f"trl-lopti {command}: no accelerator on this machine, CPU settings: {' '.join(flags)}", file=sys.stderr)
    return [*argv, *flags]


def check_model_name_or_path(model_name_or_path: str | None) -> str:
    """Returns `model_name_or_path` (a hub id or a local folder) once checked, before anything loads: it must be set,
    and be a folder when it reads as a local path."""
    if not model_name_or_path:
        raise CliError("model_name_or_path: required (a model folder or a hub id such as Qwen/Qwen2.5-3B-Instruct)")
    if model_name_or_path.startswith(("/", ".", "~")) and not Path(model_name_or_path).expanduser().is_dir():
        raise CliError(f"model_name_or_path: {model_name_or_path!r} is not a folder")
    return model_name_or_path
