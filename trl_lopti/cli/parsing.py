"""The parser of the `trl-lopti` commands: TRL's `TrlParser`, with a help that fits a screen, presets by name, the
nearest real name for a misspelt flag or key, and errors that say where a bad value came from. TRL's parser reads
`None`, `none` and `null` as `None` for every `float | None` and `int | None` field (`--lopti_threshold None`)."""

import argparse
import copy
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import torch
import yaml
from huggingface_hub import hf_hub_download
from huggingface_hub.constants import is_offline_mode
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from transformers.utils import is_peft_available
from trl import TrlParser

from .. import LoptiArguments
from .base import COMMANDS, CliError, nearest
from .classes import CONFIGS
from .preset_files import preset_path


CONFIG_HELP = "A YAML file of `field: value` lines, or a preset's name (trl-lopti presets). Flags override it."


def is_trl_lopti_module(module: str) -> bool:
    """Whether `module` is trl_lopti or one of its modules (not a user's `trl_lopti_ext`)."""
    return module == "trl_lopti" or module.startswith("trl_lopti.")


def declaring_modules(config_class: type) -> dict[str, str]:
    """
    The module of the class that declares each field of `config_class`: the first class of its MRO to annotate the
    name (`trl_lopti.config` for `lopti_threshold`, TRL's for `epsilon`, a user's module for a field of their own).

    Args:
        config_class (`type`): a dataclass.
    """
    declared_by = {}
    for cls in reversed(config_class.__mro__):
        declared_by |= dict.fromkeys(vars(cls).get("__annotations__", {}), cls.__module__)
    return {f.name: declared_by[f.name] for f in fields(config_class) if f.init}


def field_defaults(config_class: type) -> dict[str, Any]:
    """
    The default of each field of `config_class` that its constructor takes, a default factory's value included.

    Args:
        config_class (`type`): a dataclass.
    """
    defaults = {}
    for config_field in fields(config_class):
        if not config_field.init:
            continue
        defaults[config_field.name] = config_field.default
        if config_field.default_factory is not MISSING:
            defaults[config_field.name] = config_field.default_factory()
    return defaults


def own_fields(config_class: type) -> list[str]:
    """The fields that trl_lopti's classes declare in `config_class` (not TRL's or transformers' classes)."""
    return [name for name, module in declaring_modules(config_class).items() if is_trl_lopti_module(module)]


def users_fields(config_class: type) -> list[str]:
    """
    The fields that a user's classes declare in `config_class` (neither trl_lopti's, TRL's nor transformers').

    Args:
        config_class (`type`): a dataclass.
    """
    libraries = ("trl.", "transformers.")
    modules = declaring_modules(config_class)
    return [
        name for name, module in modules.items() if not (is_trl_lopti_module(module) or module.startswith(libraries))
    ]


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """argparse's formatter, with the defaults, `VALUE` for a value and no dashed alias (`--lopti-threshold`)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = copy.copy(action)
        shown.option_strings = [flag for flag in action.option_strings if "-" not in flag.lstrip("-")]
        return super()._format_action_invocation(shown)

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return "VALUE"


class LoptiParser(TrlParser):
    """
    TRL's parser of `dataclass_types` for `trl-lopti COMMAND`, which trains with the trainer of the family `trainer`
    and the Lopti config among `dataclass_types` (`CONFIGS[trainer]`, or a user's `--config_class`): `--help` fits a
    screen, `--help_all` lists every option, [`parse`] reads `--config FILE|PRESET` and the flags.

    After [`parse`]: `sources` says where each value that is not a default came from, `config` is the config file,
    and `left_out` holds the config file's values that a user's config has no field for, each at the command's own
    config's default, which the run leaves out and says.

    Args:
        dataclass_types (`Sequence[type]`): the dataclasses whose fields are the flags.
        command (`str`): the command (`grpo`, `rloo`, `demo`, `diagnose`).
        trainer (`str`, *optional*, defaults to `"grpo"`): the family of the trainer it trains.
        description (`str`, *optional*): the help's description; default: the command's line of `COMMANDS`.
    """

    def __init__(
        self, dataclass_types: Sequence[type], command: str, trainer: str = "grpo", description: str | None = None
    ):
        description = description or COMMANDS[command][1]
        super().__init__(dataclass_types, prog=f"trl-lopti {command}", description=description)
        self.allow_abbrev = False
        self.trainer = trainer
        self.config_class = next(cls for cls in dataclass_types if issubclass(cls, LoptiArguments))
        self.sources = {}
        self.config = None
        self.left_out = {}
        # transformers' parser gives the `--no_FIELD` flag of a bool field that defaults to True the field's help, which
        # it contradicts, and a default of its own (False), which is not the field's: it gets its own help, no default.
        for action in self._actions:
            if action.option_strings[:1] == [f"--no_{action.dest}"]:
                action.help = f"The opposite of --{action.dest}: sets {action.dest} to False."
                action.default = argparse.SUPPRESS

    def error(self, message: str):
        # Argparse's, with no dashed alias.
        raise CliError(re.sub(r"(--\w+)/--[\w-]+", r"\1", message))

    def format_help(self) -> str:
        formatter = Formatter(self.prog, max_help_position=34, width=119)
        formatter.add_usage(f"{self.prog} [--config FILE|PRESET] [--FIELD VALUE ...]", [], [])
        formatter.add_text(self.description)
        config = self.config_class
        lopti = own_fields(config)
        users = users_fields(config)
        own = [name for cls in self.dataclass_types if cls is not config for name in own_fields(cls)]
        # Each field's flags: a bool field that defaults to True has two, `--FIELD` and `--no_FIELD`.
        own_actions = [action for name in own for action in self._actions if action.dest == name]
        formatter.start_section("options")
        formatter.add_arguments([*OPTIONS, self._option_string_actions["-h"], *own_actions])
        formatter.end_section()
        if users:
            formatter.start_section(f"{config.__name__}'s own fields (in {config.__module__})")
            formatter.add_arguments([action for name in users for action in self._actions if action.dest == name])
            formatter.end_section()
        formatter.start_section(f"Advantage Reweighting and Lopti ({config.__name__})")
        formatter.add_arguments([action for name in lopti for action in self._actions if action.dest == name])
        formatter.end_section()
        lines = [f"and the fields of TRL's classes, as `trl {self.trainer}` reads them (--help_all):"]
        libraries = ("trl.", "transformers.")
        # By the TRL class each extends: ScriptArguments, GRPOConfig (GMPOConfig), ModelConfig.
        for cls in self.dataclass_types:
            names = [f.name for f in fields(cls) if f.init and f.name not in own + lopti + users]
            # A class of trl_lopti's alone (the arguments of `demo` or `diagnose`) is listed above.
            base = next((k.__name__ for k in cls.__mro__ if k.__module__.startswith(libraries)), None)
            if names and base is not None:
                lines.append(f"  {base} ({len(names)}): --{', --'.join(names[:4])}, ...")
        formatter.add_text("\n".join(lines))
        return formatter.format_help()

    def parse(self, argv: Sequence[str], added: dict[str, Any] | None = None) -> tuple:
        """The dataclasses from `--config FILE|PRESET` (a YAML mapping; `env:` sets environment variables, as TRL's
        parser does) and the flags, which win, and the settings `added` for this machine that no flag gives. `sources`
        says where the values that are not defaults came from: `config_file`, `flags` or `this_machine`."""
        args = [part for a in argv for part in (a.split("=", 1) if a.startswith("--config=") else [a])]
        values = {}
        if "--help_all" in args:
            print(super().format_help())
            raise SystemExit(0)
        if "--config" in args:
            index = args.index("--config")
            if index + 1 == len(args):
                raise CliError("--config: expected a YAML file or a preset's name (trl-lopti presets lists them)")
            self.config = preset_path(args.pop(index + 1))
            del args[index]
            try:
                values = yaml.safe_load(self.config.read_text())
            except (OSError, yaml.YAMLError) as error:
                raise CliError(f"--config {self.config}: {error}") from error
            if not isinstance(values, dict) or not isinstance(values.get("env", {}), dict):
                raise CliError(f"--config {self.config}: must be a YAML mapping of field: value (env: a mapping too)")
            os.environ.update({name: str(value) for name, value in values.pop("env", {}).items()})
            # A check: the command is the trainer.
            if values.setdefault("trainer", self.trainer) != self.trainer:
                raise CliError(f"trainer: {self.config} is for `trl-lopti {values['trainer']}`, not {self.prog}")
            del values["trainer"]
        options = self._option_string_actions
        names = [action.dest for action in self._actions]
        self.left_out = {}
        stock_config = CONFIGS.get(self.trainer)
        # The config file's values at a default of the command's own config that a user's config lacks (a preset's
        # `advantage_estimator: grpo` under a `GMPOConfig`): left out, and said.
        if stock_config is not None and self.config_class is not stock_config:
            stock_defaults = field_defaults(stock_config)
            for name in [name for name in values if name not in names and name in stock_defaults]:
                if values[name] == stock_defaults[name]:
                    self.left_out[name] = values.pop(name)
        flags = [arg.split("=")[0] for arg in args if arg.startswith("--")]
        for name, known in [*((key, names) for key in values), *((flag, list(options)) for flag in flags)]:
            if name not in known:
                raise self.unknown(name, known)
        given = {options[flag].dest for flag in flags}
        self.sources = dict.fromkeys(values, "config_file") | dict.fromkeys(given, "flags")
        for name, value in (added or {}).items():
            if name not in given:
                args.append(f"--{name}={value}")
                self.sources[name] = "this_machine"
        self.set_defaults_with_config(**values)
        try:
            return tuple(self.parse_args_into_dataclasses(args))
        # TypeError: a user's config refused when it is built (several configs composed without @dataclass).
        except (TypeError, ValueError) as error:
            message = str(error)
            # Transformers' bf16 check, on a CPU.
            if "use_cpu" in message and not torch.accelerator.is_available():
                message += "; this machine has no accelerator: add --use_cpu true to run on its CPU"
            raise CliError(self.where(message)) from error

    def where(self, message: str) -> str:
        """An error `message` with where the value of each field it names came from: the field it starts with (`name:
        ...`), and the fields it names that the config file, a flag or this machine set."""
        first = [name for name in re.findall(r"^(\w+):", message) if name in {a.dest for a in self._actions}]
        named = dict.fromkeys([*first, *(name for name in self.sources if re.search(rf"\b{name}\b", message))])
        origins = {
            "config_file": f"the config file {self.config}",
            "flags": "the flag --{}",
            "this_machine": "CPU settings",
        }
        where = "; ".join(f"{n} from {origins.get(self.sources.get(n), 'its default').format(n)}" for n in named)
        return message + (f" ({where})" if where else "")

    def unknown(self, name: str, known: list[str]) -> CliError:
        """The error for a flag or key `name` that none of the command's `known` names is."""
        field = name.removeprefix("--")
        origin, kind = ("a flag", "option") if field != name else (f"the config file {self.config}", "field")
        stock_config = CONFIGS.get(self.trainer)
        if stock_config is not None and field in stock_config.__dataclass_fields__:
            lacks = f"a field of {stock_config.__name__}, which {self.config_class.__name__} does not have"
            if field != name:
                return CliError(f"{name} ({origin}): {lacks}")
            return CliError(
                f"{name} ({origin}): {lacks}; the file sets it to other than {stock_config.__name__}'s default, so the "
                "run would not be the one the file describes"
            )
        others = {t: c.__name__ for t, c in CONFIGS.items() if t != self.trainer and field in c.__dataclass_fields__}
        if field == "trainer" or others:
            what = "".join(f"a field of {c}, which `trl-lopti {t}` reads; " for t, c in others.items())
            return CliError(f"{name} ({origin}): {what}the trainer is the command: trl-lopti grpo or trl-lopti rloo")
        return CliError(f"{name} ({origin}): no such {kind}{nearest(name, known)}")


# The options `parse` reads itself, as `--help` shows them.
OPTIONS = [
    argparse.Action(["--config"], "config", metavar="FILE|PRESET", default=argparse.SUPPRESS, help=CONFIG_HELP),
    argparse.Action(["--help_all"], "help_all", 0, default=argparse.SUPPRESS, help="Every option, and exit."),
]


def cpu_settings(argv: Sequence[str], command: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The CPU settings (default `use_cpu=True`) a side tool (`demo`, `diagnose`, `--rehearse`, `--dry_run`) adds on a
    machine without an accelerator, where TRL's default bf16 would refuse to start, but those `argv` gives; said once."""
    given = {arg.split("=")[0] for arg in argv}
    added = {name: value for name, value in (settings or {"use_cpu": True}).items() if f"--{name}" not in given}
    # Once under a launcher.
    if added and os.environ.get("RANK", "0") == "0":
        flags = " ".join(f"--{name}={value}" for name, value in added.items())
        print(f"{command}: no accelerator on this machine, CPU settings: {flags}", file=sys.stderr)
    return added


def check_model_name_or_path(model_name_or_path: str | None) -> str:
    """`model_name_or_path` (a hub id, or a folder when it reads as a path) checked before anything loads."""
    if not model_name_or_path:
        raise CliError("model_name_or_path: required (a model folder or a hub id such as Qwen/Qwen2.5-3B-Instruct)")
    if model_name_or_path.startswith(("/", ".", "~")) and not Path(model_name_or_path).expanduser().is_dir():
        raise CliError(f"model_name_or_path: {model_name_or_path!r} is not a folder")
    return model_name_or_path


def check_model_args(model_args) -> None:
    """TRL's `ModelConfig` checked before anything loads: its `model_name_or_path` ([`check_model_name_or_path`]), and
    PEFT installed where `use_peft` asks for LoRA (TRL's `get_peft_config` would raise its own error later).

    Args:
        model_args (`trl.ModelConfig`): the model's arguments.
    """
    check_model_name_or_path(model_args.model_name_or_path)
    if model_args.use_peft and not is_peft_available():
        raise CliError("use_peft: LoRA needs PEFT, which is not installed: pip install 'trl_lopti[peft]'")


def check_model_reachable(model_name_or_path: str, revision: str | None = None) -> None:
    """A `model_name_or_path` that is no folder, looked up as a hub id before anything loads: its `config.json`, which
    the trainer would fetch first, from this machine's Hub cache or the Hub. Raises a [`CliError`] that names the path
    and the Hub where neither has it; with `HF_HUB_OFFLINE=1` the Hub is not asked, and the answer takes no time.

    Args:
        model_name_or_path (`str`): a model folder or a hub id.
        revision (`str`, *optional*): the hub revision (`model_revision`).
    """
    if Path(model_name_or_path).expanduser().is_dir():
        return
    where = f"{model_name_or_path!r} is no folder in {os.getcwd()}"
    try:
        hf_hub_download(model_name_or_path, "config.json", revision=revision)
    except HFValidationError as error:
        raise CliError(f"model_name_or_path: {where}, nor a hub id (owner/name: letters, digits, -, _, .)") from error
    except GatedRepoError as error:
        raise CliError(
            f"model_name_or_path: {model_name_or_path!r} is a gated model on the Hub: accept its terms on its page, "
            "then log in (hf auth login)"
        ) from error
    except RepositoryNotFoundError as error:
        raise CliError(
            f"model_name_or_path: {where}, nor a model on the Hub (none of that name, or a private one: log in with "
            "hf auth login)"
        ) from error
    except RevisionNotFoundError as error:
        raise CliError(
            f"model_revision: the Hub's model {model_name_or_path!r} has no revision {revision!r}"
        ) from error
    except LocalEntryNotFoundError as error:
        reason = "HF_HUB_OFFLINE=1: the Hub is not asked"
        if not is_offline_mode():
            reason = "the Hub cannot be reached; with HF_HUB_OFFLINE=1 it is not asked"
        raise CliError(f"model_name_or_path: {where}, nor a model in this machine's Hub cache ({reason})") from error
    except EntryNotFoundError:
        # A model on the Hub without a config.json: the trainer's loader says what it lacks.
        return
    except HfHubHTTPError as error:
        said = str(error).splitlines()[0]
        raise CliError(f"model_name_or_path: {where}, and the Hub could not say whether it has it ({said})") from error
