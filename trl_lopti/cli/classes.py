"""The classes a run of `trl-lopti grpo` or `trl-lopti rloo` trains with: [`LoptiGRPOTrainer`] and [`LoptiGRPOConfig`]
(RLOO's for `rloo`), or a user's `--trainer_class MODULE.CLASS` and `--config_class MODULE.CLASS`, imported from the
current folder in every process of a launch, before the flags are parsed (the config's fields are the flags)."""

from collections.abc import Sequence
from pathlib import Path

import yaml
from trl import GRPOTrainer, RLOOTrainer

from .. import LoptiArguments, LoptiGRPOConfig, LoptiGRPOTrainer, LoptiRLOOConfig, LoptiRLOOTrainer
from ..config import LOPTI_CONFIGS, check_config_fits, default_config_class, lopti_config_spelling
from ..lopti_mixin import LoptiTrainerMixin
from .base import CliError, import_class
from .preset_files import preset_path


TRAINERS = {"grpo": LoptiGRPOTrainer, "rloo": LoptiRLOOTrainer}
"""The trainer of each training command when no `--trainer_class` names another."""

TRL_TRAINERS = {"grpo": GRPOTrainer, "rloo": RLOOTrainer}
"""The TRL trainer each training command's family extends."""

CONFIGS = {"grpo": LoptiGRPOConfig, "rloo": LoptiRLOOConfig}
"""The training commands (`trl-lopti grpo`, `trl-lopti rloo`) and the config whose fields each reads by default."""


def last_flag_value(argv: Sequence[str], name: str) -> str | None:
    """
    The value of the last `--NAME VALUE` or `--NAME=VALUE` in `argv`, as argparse takes it, or `None`.

    Args:
        argv (`Sequence[str]`): the arguments after the command.
        name (`str`): the option's name, without its dashes.
    """
    flag = f"--{name}"
    value = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def given_class_path(argv: Sequence[str], name: str) -> str | None:
    """The value of the option `name` (`trainer_class` or `config_class`) in `argv`: its last flag, else the key of the
    `--config` file. Read before parsing, since the config class decides which flags there are; the parser reads the
    option again as a field of `LoptiScriptArguments`.

    Args:
        argv (`Sequence[str]`): the arguments after the command.
        name (`str`): the option's name.
    """
    value = last_flag_value(argv, name)
    if value is not None:
        return value
    from_file = config_file_values(argv).get(name)
    return None if from_file is None else str(from_file)


def config_file_values(argv: Sequence[str]) -> dict:
    """The mapping of the `--config` file or preset that `argv` names, or `{}` (the parser reports a bad file).

    Args:
        argv (`Sequence[str]`): the arguments after the command.
    """
    name = last_flag_value(argv, "config")
    if name is None:
        return {}
    try:
        values = yaml.safe_load(Path(preset_path(name)).read_text())
    except (CliError, OSError, yaml.YAMLError):
        return {}
    return values if isinstance(values, dict) else {}


def trainer_class_of(command: str, trainer_path: str | None) -> type:
    """The trainer `trl-lopti COMMAND` trains: the command's own, or the Lopti trainer of its family at
    `trainer_path` (`MODULE.CLASS`).

    Args:
        command (`str`): `grpo` or `rloo`.
        trainer_path (`str`, *optional*): the value of `--trainer_class`.
    """
    if trainer_path is None:
        return TRAINERS[command]
    trainer_class = import_class(trainer_path, "--trainer_class")
    name = trainer_class.__name__
    if not issubclass(trainer_class, TRL_TRAINERS["grpo"] | TRL_TRAINERS["rloo"]):
        raise CliError(
            f"--trainer_class {trainer_path}: {name} is not a trainer (no subclass of TRL's GRPOTrainer or RLOOTrainer)"
        )
    family = next(family for family, trl_trainer in TRL_TRAINERS.items() if issubclass(trainer_class, trl_trainer))
    lopti = TRAINERS[family].__name__
    if trainer_class is TRL_TRAINERS[family]:
        raise CliError(
            f"--trainer_class {trainer_path}: {name} is TRL's own trainer: trl-lopti {family} trains it with AR and "
            f"Lopti ({lopti}), with no --trainer_class"
        )
    if not issubclass(trainer_class, LoptiTrainerMixin):
        raise CliError(
            f"--trainer_class {trainer_path}: {name} is not a Lopti trainer: compose it with one, Lopti class first, "
            f"e.g. `class Lopti{name}({lopti}, {name})`, and give that class to trl-lopti {family}"
        )
    if family != command:
        raise CliError(
            f"--trainer_class {trainer_path}: {name} is a {lopti}, which trains with trl-lopti {family}, not "
            f"trl-lopti {command}"
        )
    return trainer_class


def config_class_of(trainer_class: type, config_path: str | None) -> type:
    """The config whose fields a run of `trainer_class` reads: the one at `config_path` (`MODULE.CLASS`), which must
    fit the trainer and hold the Lopti fields; else the `config_class` the trainer declares, or its family's Lopti
    config. A trainer whose base comes with a config of its own (`GMPOTrainer`: `GMPOConfig`) is never given the
    family's silently: the run stops, naming the config to write.

    Args:
        trainer_class (`type`): the run's trainer.
        config_path (`str`, *optional*): the value of `--config_class`.
    """
    if config_path is not None:
        config_class = import_class(config_path, "--config_class")
        try:
            check_config_fits(trainer_class, config_class)
        except TypeError as error:
            raise CliError(f"--config_class {config_path}: {error}") from None
        if not issubclass(config_class, LoptiArguments):
            raise CliError(
                f"--config_class {config_path}: {config_class.__name__} holds no field of Advantage Reweighting and "
                f"Lopti: give a {lopti_config_spelling(config_class)}"
            )
        # A trainer whose base has no config of its own trains with its family's Lopti config (`LoptiGRPOConfig`):
        # another trainer's (`LoptiGMPOConfig`, whose epsilon is a log-space range) would train it with other defaults.
        family_config = LOPTI_CONFIGS.get(default_config_class(trainer_class))
        if family_config is not None and not issubclass(config_class, family_config):
            raise CliError(
                f"--config_class {config_path}: {config_class.__name__} does not fit {trainer_class.__name__}, which "
                f"trains with a {family_config.__name__}: give a {family_config.__name__} or a subclass of it"
            )
        return config_class
    default_config = default_config_class(trainer_class)
    if issubclass(default_config, LoptiArguments):
        return default_config
    if default_config in LOPTI_CONFIGS:
        return LOPTI_CONFIGS[default_config]
    module = trainer_class.__module__
    name = f"Lopti{default_config.__name__}"
    raise CliError(
        f"--trainer_class {module}.{trainer_class.__qualname__} trains with a {default_config.__name__}, which holds "
        f"no field of Advantage Reweighting and Lopti: define `@dataclass class {name}(trl_lopti.LoptiArguments, "
        f"{default_config.__name__})` in {module} and give --config_class {module}.{name}"
    )
