"""The training runs of `trl-lopti grpo` and `trl-lopti rloo` (`train_command`): TRL's `trl grpo` and `trl rloo` with
[`LoptiGRPOTrainer`] and [`LoptiRLOOTrainer`] and the paper's tasks or your data; the fields of the trainer's config,
TRL's `ModelConfig` and [`LoptiScriptArguments`], from `--config FILE|PRESET` and flags."""

import dataclasses
import importlib
import inspect
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import PartialState
from datasets.exceptions import DatasetGenerationError
from transformers import AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint
from trl import ModelConfig, RLOOConfig, ScriptArguments, get_peft_config, get_quantization_config

from .. import tasks
from .base import CliError
from .classes import CONFIGS, TRAINERS, config_class_of, given_class_path, trainer_class_of
from .parsing import (
    LoptiParser,
    check_model_args,
    check_model_reachable,
    cpu_settings,
    field_defaults,
    own_fields,
)


REWARD_FUNCS = {
    "knights_knaves_reward": "trl_lopti.tasks.knights_knaves.knights_knaves_reward",
    "knights_knaves_format_reward": "trl_lopti.tasks.knights_knaves.knights_knaves_format_reward",
    "knights_knaves_answer_reward": "trl_lopti.tasks.knights_knaves.knights_knaves_answer_reward",
    "math_reward": "trl_lopti.tasks.math.math_reward",
    "math_reward_lenient": "trl_lopti.tasks.math.math_reward_lenient",
    "accuracy_reward": "trl.rewards.accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards.reasoning_accuracy_reward",
    "think_format_reward": "trl.rewards.think_format_reward",
    "token_parity_reward": "trl_lopti.tasks.token_parity_reward",
}
"""Reward functions known by name to `reward_funcs`; any dotted import path (`my_module.my_reward`) works too."""

DEFAULT_REWARD_FUNCS = {"knights_knaves": ["knights_knaves_reward"], "math": ["math_reward"], "dataset": []}
"""The tasks (values of `task`) and the reward functions of each when `reward_funcs` is unset."""

DATA_FILE_SUFFIXES = {".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".txt"}
"""The extensions of the data files `datasets` reads (compressed too: `.jsonl.gz`)."""

RESUME_STEPS = frozenset({"_load_from_checkpoint", "_load_optimizer_and_scheduler"})
"""The methods by which `Trainer.train` loads the checkpoint it resumes from (the Lopti trainers extend the second: a
checkpoint taken inside a generation batch must be resumed with its schedule). A `ValueError` raised inside one of them
while a run resumes is about the checkpoint the user named: [`run_training`] makes it a one-line error."""

JSON_BUILDER_LOGGER = "datasets.packaged_modules.json.json"
"""The logger of `datasets`' JSON builder, which logs a file it cannot read before it raises; [`build_datasets`] says
which line of the file is not JSON instead."""


@dataclass
class LoptiScriptArguments(ScriptArguments):
    """Script arguments of `trl-lopti grpo` and `rloo`: TRL's `ScriptArguments` (`dataset_name`, `dataset_config`,
    `dataset_train_split`, `dataset_test_split`: the evaluation set when `eval_strategy` is not `"no"`) plus these."""

    task: str | None = field(
        default=None,
        metadata={
            "help": "'knights_knaves' (see kk_source), 'math' (a paper set or a math dataset of trl_lopti.tasks.math) "
            "or 'dataset' (your data: a data file, a folder or a hub id). None: 'dataset' for a dataset_name that is "
            "not the paper's."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Names of REWARD_FUNCS or dotted import paths; None: the task's reward."}
    )
    kk_source: str | None = field(
        default=None,
        metadata={
            "help": "K&K data: 'paper' (the authors' split and prompts), 'hub' (dataset_name) or 'generated' "
            "(kk_num_samples puzzles from kk_seed); None: 'hub' with a dataset_name, else 'generated'."
        },
    )
    kk_num_people: list[int] = field(
        default_factory=lambda: [3], metadata={"help": "K&K puzzle sizes (2-8; the paper's: 3-7); several: a mixture."}
    )
    kk_num_samples: int = field(default=1000, metadata={"help": "Generated K&K training puzzles."})
    kk_num_eval_samples: int = field(default=100, metadata={"help": "Generated K&K evaluation puzzles."})
    kk_seed: int = field(default=0, metadata={"help": "Seed of the K&K generator."})
    kk_prefill_think: bool = field(default=True, metadata={"help": "End K&K prompts with an assistant '<think>'."})
    kk_data_dir: str | None = field(default=None, metadata={"help": "kk_source 'paper': a local copy of its data."})
    math_data_file: str | None = field(default=None, metadata={"help": "A paper math set: a local copy of its file."})
    trainer_class: str | None = field(
        default=None, metadata={"help": "MODULE.CLASS of your own Lopti trainer, from the current folder."}
    )
    config_class: str | None = field(default=None, metadata={"help": "MODULE.CLASS of its config."})
    dry_run: bool = field(default=False, metadata={"help": "Print the resolved configuration; load no model."})
    rehearse: bool = field(default=False, metadata={"help": "Rehearse offline: tiny model, one Lopti cycle, resume."})

    def __post_init__(self):
        self.reward_funcs = [self.reward_funcs] if isinstance(self.reward_funcs, str) else self.reward_funcs
        self.kk_num_people = [self.kk_num_people] if isinstance(self.kk_num_people, int) else self.kk_num_people
        math_sets = [*tasks.PAPER_MATH_FILES, *tasks.MATH_DATASETS]
        # No task named: a dataset name means the user's data, as in `trl grpo`, unless it names the paper's data.
        if self.task is None and self.dataset_name in math_sets:
            self.task = "math"
        elif self.task is None:
            kk_data = self.kk_source is not None or self.dataset_name in (None, tasks.KNIGHTS_KNAVES_HUB_ID)
            self.task = "knights_knaves" if kk_data else "dataset"
        if self.task not in DEFAULT_REWARD_FUNCS:
            raise ValueError(f"task: must be one of {list(DEFAULT_REWARD_FUNCS)}, got {self.task!r}")
        if self.kk_source not in (None, "paper", "hub", "generated"):
            raise ValueError(f"kk_source: must be 'paper', 'hub', 'generated' or unset, got {self.kk_source!r}")
        if not self.kk_num_people or not all(isinstance(n, int) and 2 <= n <= 8 for n in self.kk_num_people):
            raise ValueError(f"kk_num_people: every size must be an integer from 2 to 8, got {self.kk_num_people!r}")
        if self.task == "math" and self.dataset_name not in math_sets:
            raise ValueError(f"dataset_name: task 'math' takes one of {math_sets}; your own data: --task dataset")
        if self.task == "dataset" and not (self.dataset_name and self.reward_funcs):
            raise ValueError(f"{'reward_funcs' if self.dataset_name else 'dataset_name'}: required for task 'dataset'")
        if self.dataset_streaming:
            raise ValueError("dataset_streaming: trl-lopti does not stream datasets")
        # A name that can only be a local path: a data file's extension, or a path's separator (a hub id has one `/`).
        name = self.dataset_name or ""
        local = name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
        local = local or bool(DATA_FILE_SUFFIXES & set(Path(name).suffixes))
        # Checked here, in seconds: `datasets` would look for a missing local path on the Hub, retrying for a while.
        if local and not Path(name).expanduser().exists():
            raise ValueError(
                f"dataset_name: no file or folder {self.dataset_name!r} in {os.getcwd()} (task {self.task!r}; "
                "--task dataset reads your data: a data file, a folder or a hub id)"
            )
        if Path(name).expanduser().is_file() and self.task == "knights_knaves" and self.kk_source in (None, "hub"):
            raise ValueError(
                f"dataset_name: {self.dataset_name!r} is your data, not K&K puzzles (task 'knights_knaves' reads "
                "them from the hub, the paper or the generator, see kk_source): train on it with --task dataset"
            )


def train_parser(trainer: str, argv: Sequence[str] = ()) -> LoptiParser:
    """
    The parser of `trl-lopti grpo` or `trl-lopti rloo`: the fields of the config of the trainer class that `argv`
    names (`--trainer_class`, `--config_class`), else of the command's own.

    Args:
        trainer (`str`): the command, `grpo` or `rloo`.
        argv (`Sequence[str]`, *optional*): the arguments after the command.
    """
    trainer_class = trainer_class_of(trainer, given_class_path(argv, "trainer_class"))
    config_class = config_class_of(trainer_class, given_class_path(argv, "config_class"))
    description = None
    if trainer_class is not TRAINERS[trainer]:
        description = (
            f"train {trainer_class.__module__}.{trainer_class.__qualname__} with {config_class.__name__}, from a "
            "preset, a YAML file and flags"
        )
    return LoptiParser((LoptiScriptArguments, config_class, ModelConfig), trainer, trainer, description)


def parse_train_args(argv: Sequence[str], trainer: str = "grpo", added: dict | None = None, parser=None) -> tuple:
    """`(LoptiScriptArguments, the trainer's config, ModelConfig)` from `--config FILE|PRESET` and flags, and the settings
    `added` for this machine (default: a dry run's CPU settings where there is no accelerator)."""
    if added is None and "--dry_run" in argv and not torch.accelerator.is_available():
        added = cpu_settings(argv, f"trl-lopti {trainer} --dry_run")
    return (parser or train_parser(trainer, argv)).parse(argv, added)


def family_of(training_args) -> str:
    """
    The family of trainer that `training_args` configures, the command that trains it: `"grpo"` or `"rloo"`.

    Args:
        training_args (`GRPOConfig` or `RLOOConfig`): a run's config.
    """
    return "rloo" if isinstance(training_args, RLOOConfig) else "grpo"


def run_trainer_class(script_args: "LoptiScriptArguments", training_args) -> type:
    """
    The trainer class a run trains: its `trainer_class`, else the command's own ([`trainer_class_of`]).

    Args:
        script_args (`LoptiScriptArguments`): the run's arguments, `trainer_class` among them.
        training_args (`GRPOConfig` or `RLOOConfig`): the run's config, whose family is the command's.
    """
    return trainer_class_of(family_of(training_args), script_args.trainer_class)


def check_trainer_accepts(trainer_class: type, training_args) -> None:
    """
    Raises a [`CliError`] where `trainer_class` refuses `training_args` as it would when built (AR with a KL term in a
    loss that is not TRL's token-level one), in its own words, before anything loads. A class that overrides
    `advantage_reweighting_form` as an instance method is asked when it is built.

    Args:
        trainer_class (`type`): the run's trainer.
        training_args (`LoptiArguments`): the run's config.
    """
    form = inspect.getattr_static(trainer_class, "advantage_reweighting_form")
    if not isinstance(form, classmethod):
        return
    try:
        trainer_class.advantage_reweighting_form(training_args)
    except ValueError as error:
        raise CliError(str(error)) from None


def resolve_reward_funcs(script_args: LoptiScriptArguments) -> dict[str, Callable]:
    """The reward functions of a run by name, imported as `trl/scripts/grpo.py` imports them."""
    funcs = {}
    sys.path.insert(0, os.getcwd())
    for name in script_args.reward_funcs or DEFAULT_REWARD_FUNCS[script_args.task]:
        module_name, _, attribute = REWARD_FUNCS.get(name, name).rpartition(".")
        if not module_name:
            raise CliError(f"reward_funcs: {name!r} is neither one of {sorted(REWARD_FUNCS)} nor a dotted import path")
        try:
            funcs[name] = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise CliError(f"reward_funcs: cannot import {name!r}: {error}") from error
    return funcs


def resolved_config(parser: LoptiParser, script_args, training_args, model_args) -> dict[str, Any]:
    """What `--dry_run` prints: the device, the completions per micro-step, optimizer step and generation batch on each
    process and on all processes of this launch, the reward functions, the AR and Lopti fields, then every field as the
    run would have it on this machine (`to_dict`: JSON), grouped by where its value came from."""
    values = {**dataclasses.asdict(script_args), **dataclasses.asdict(model_args), **training_args.to_dict()}
    args = training_args
    groups = {"config_file": {}, "flags": {}, "this_machine": {}, "defaults": {}}
    for name, value in values.items():
        groups[parser.sources.get(name, "defaults")][name] = value
    steps = (1, args.gradient_accumulation_steps, args.steps_per_generation)
    per_process = dict(zip(("micro_step", "optimizer_step", "generation_batch"), steps, strict=True))
    per_process = {name: args.per_device_train_batch_size * count for name, count in per_process.items()}
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    trainer_class = run_trainer_class(script_args, training_args)
    return {
        "command": parser.prog,
        "trainer": f"{trainer_class.__module__}.{trainer_class.__qualname__}",
        "config": f"{type(args).__module__}.{type(args).__qualname__}",
        "device": f"{args.device}, {args.world_size} process(es), mixed precision: {precision}",
        "completions": {
            "per_process": per_process,
            "all_processes": {name: size * args.world_size for name, size in per_process.items()},
            "prompts_per_generation_batch": args.generation_batch_size // args.num_generations,  # (on all processes)
        },
        "reward_funcs": list(resolve_reward_funcs(script_args)),
        "lopti": {name: values[name] for name in own_fields(type(args))},
        **groups,
    }


def json_error_line(path: Path) -> str | None:
    """Where the JSON data file `path` (JSON Lines, or one JSON document) stops being JSON, by 1-based line number,
    e.g. `line 3 is not JSON: Expecting ',' delimiter (column 15)`, or that it holds only blank lines; `None` where it
    parses, or is not a `.json` or `.jsonl` file.

    Args:
        path (`Path`): the data file.
    """
    if path.suffix not in (".json", ".jsonl"):
        return None
    text = path.read_text(errors="replace")
    if not text.strip():
        return "it holds only blank lines"
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as error:
        found = error
    # Values after the first one: JSON Lines, read line by line; else one document, whose error says where.
    if found.msg == "Extra data":
        for number, line in enumerate(text.splitlines(), start=1):
            try:
                if line.strip():
                    json.loads(line)
            except json.JSONDecodeError as error:
                return f"line {number} is not JSON: {error.msg} (column {error.colno})"
        return None
    return f"line {found.lineno} is not JSON: {found.msg} (column {found.colno})"


def resolve_checkpoint(training_args) -> None:
    """Sets `resume_from_checkpoint` to the folder the run resumes from, checked before anything loads: `true` (the
    flag's text, or YAML's `true`) is the latest `checkpoint-N` folder in `output_dir`, as `Trainer.train`'s `True`,
    `false` none; any other value must be a checkpoint folder (one that holds a `trainer_state.json`).

    Args:
        training_args (`LoptiGRPOConfig` or `LoptiRLOOConfig`): the trainer's config.
    """
    value = training_args.resume_from_checkpoint
    if value is None or str(value).lower() == "false":
        training_args.resume_from_checkpoint = None
        return
    if str(value).lower() == "true":
        output_dir = training_args.output_dir
        value = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if value is None:
            raise CliError(
                "resume_from_checkpoint: true resumes from the latest checkpoint-N folder in output_dir, and "
                f"{output_dir} holds none: train without it first, or name a checkpoint folder"
            )
    state = Path(value).expanduser() / "trainer_state.json"
    if not state.is_file():
        raise CliError(
            f"resume_from_checkpoint: {str(value)!r} is no checkpoint folder (it holds no trainer_state.json): name a "
            "checkpoint-N folder that a run saved, or true for the latest one in output_dir"
        )
    training_args.resume_from_checkpoint = str(state.parent)


def raised_while_resuming(error: BaseException) -> bool:
    """Whether `error` was raised inside one of [`RESUME_STEPS`] (by it, or by a function it called).

    Args:
        error (`BaseException`): the error, with its traceback.
    """
    return any(frame.name in RESUME_STEPS for frame in traceback.extract_tb(error.__traceback__))


def build_datasets(script_args: LoptiScriptArguments, training_args) -> tuple:
    """The task's training set and, when `eval_strategy` is not `"no"`, its evaluation set (else `None`)."""
    args = script_args
    with_eval = training_args.eval_strategy != "no"
    kk_source = args.kk_source or ("hub" if args.dataset_name else "generated")
    # Held out: the puzzles after the training ones.
    if args.task == "knights_knaves" and kk_source == "generated":
        total = args.kk_num_samples + (args.kk_num_eval_samples if with_eval else 0)
        puzzles = tasks.generate_dataset(
            args.kk_num_people, total, seed=args.kk_seed, prefill_think=args.kk_prefill_think
        )

    def load(split: str, train: bool):
        if args.task == "knights_knaves" and kk_source == "generated":
            return puzzles.select(range(args.kk_num_samples) if train else range(args.kk_num_samples, total))
        if args.task == "knights_knaves":
            hub_id = args.dataset_name or tasks.KNIGHTS_KNAVES_HUB_ID
            prefill = args.kk_prefill_think
            kk = (args.kk_num_people, split, kk_source, args.kk_data_dir, hub_id)
            return tasks.load_knights_knaves_dataset(*kk, prefill_think=prefill)
        # Two math sets: dataset_name, and dataset_test_split to evaluate on.
        if args.task == "math":
            name = args.dataset_name if train else split
            if name in tasks.PAPER_MATH_FILES:
                return tasks.load_paper_math_dataset(name, args.math_data_file if train else None)
            return tasks.load_math_dataset(name)
        # Resolved: a bare name's parent "." would read as no folder.
        path = Path(args.dataset_name).expanduser().resolve()
        # A hub id, a folder of data files or a `save_to_disk` folder.
        if not path.is_file():
            return datasets.load_dataset(args.dataset_name, args.dataset_config, split=split)
        if not path.stat().st_size:
            raise CliError(f"dataset_name: the data file {path} is empty")
        # All its rows in either split; the builder (json, parquet, ...) follows from its extension.
        json_logger = logging.getLogger(JSON_BUILDER_LOGGER)
        level = json_logger.level
        json_logger.setLevel(logging.CRITICAL)
        try:
            return datasets.load_dataset(str(path.parent), data_files=path.name, split="train")
        except (DatasetGenerationError, StopIteration, ValueError) as error:
            said = json_error_line(path) or error.__cause__ or error
            raise CliError(f"dataset_name: cannot read the data file {path}: {said}") from error
        finally:
            json_logger.setLevel(level)

    try:
        train = load(args.dataset_train_split, train=True)
        evaluation = load(args.dataset_test_split, train=False) if with_eval else None
    except CliError:
        raise
    except (OSError, ValueError) as error:
        raise CliError(f"cannot load the {args.task} data: {error}") from error
    if "prompt" not in train.column_names:
        raise CliError(f"dataset_name: the training data has no 'prompt' column (columns: {train.column_names})")
    return train, evaluation


def policy_model_init_kwargs(training_args, model_args) -> dict[str, Any]:
    """How TRL loads the policy (and reference model) from the path, as `trl/scripts/grpo.py` sets it."""
    return {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }


def build_trainer(script_args, training_args, model_args, num_train_prompts: int | None = None):
    """The trainer of `trl-lopti grpo` ([`LoptiGRPOTrainer`]) or `rloo` ([`LoptiRLOOTrainer`]), as the type of
    `training_args` says; `trl-lopti diagnose`: on its first `num_train_prompts` prompts."""
    check_model_reachable(model_args.model_name_or_path, model_args.model_revision)
    training_args.model_init_kwargs = policy_model_init_kwargs(training_args, model_args)
    train_dataset, eval_dataset = build_datasets(script_args, training_args)
    if num_train_prompts is not None:
        train_dataset = train_dataset.select(range(min(num_train_prompts, len(train_dataset))))
    if script_args.task == "knights_knaves" and script_args.kk_prefill_think:
        # GRPO and RLOO never continue a final assistant message: give them the "<think>"-prefilled prompts as text.
        revision = model_args.model_revision
        trust_remote_code = training_args.trust_remote_code
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.model_name_or_path, revision=revision, trust_remote_code=trust_remote_code
        )
        train_dataset = tasks.render_prompts_as_text(train_dataset, tokenizer)
        eval_dataset = tasks.render_prompts_as_text(eval_dataset, tokenizer) if eval_dataset is not None else None
    trainer_class = run_trainer_class(script_args, training_args)
    try:
        return trainer_class(
            model=model_args.model_name_or_path,
            reward_funcs=list(resolve_reward_funcs(script_args).values()),
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            quantization_config=get_quantization_config(model_args),
            peft_config=get_peft_config(model_args),
        )
    except ValueError as error:
        # A combination the trainer refuses (AR with a KL term in a loss that is not TRL's token-level one), in the
        # trainer's own words.
        if not str(error).startswith(f"{trainer_class.__name__}: "):
            raise
        raise CliError(str(error)) from None


def launch_backend(training_args, num_processes: int) -> str:
    """What the processes of a launch train with, before accelerate's `Accelerator` decides it: DeepSpeed or FSDP
    (from `accelerate launch`'s config, or the trainer's own `deepspeed` and `fsdp`), DDP, or nothing for one
    process."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" or training_args.deepspeed:
        return "DeepSpeed"
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" or training_args.fsdp:
        return "FSDP"
    return "DDP" if num_processes > 1 else ""


def run_training(
    script_args, training_args, model_args, end: bool = True, prepare: Callable | None = None, say_where: bool = True
):
    """Trains and saves the trainer of [`build_trainer`] as `trl grpo` (`trl rloo`) does.

    Args:
        script_args (`LoptiScriptArguments`):
            The task's arguments.
        training_args (`LoptiGRPOConfig` or `LoptiRLOOConfig`):
            The trainer's config.
        model_args (`trl.ModelConfig`):
            The model's arguments.
        end (`bool`, *optional*, defaults to `True`):
            Whether to end its trackers and process group once every process has arrived.
        prepare (`Callable`, *optional*):
            Called with the trainer before it trains.
        say_where (`bool`, *optional*, defaults to `True`):
            Whether the run's first line (the main process's, once) says its device and number of processes.
    """
    command = f"trl-lopti {family_of(training_args)}"
    # Before anything loads: `training on cpu, 1 process`, `training on cuda (NVIDIA H100 80GB HBM3), 4 processes
    # (FSDP)`; `training my_trainers.LoptiGMPOTrainer on cpu, 1 process` for a user's trainer class.
    state = PartialState()
    if say_where and state.is_main_process:
        device = training_args.device
        count = state.num_processes
        backend = launch_backend(training_args, count)
        where = f"{device.type} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type
        where += f", {count} process{'es' * (count > 1)}" + (f" ({backend})" if backend else "")
        trained = "" if script_args.trainer_class is None else f" {script_args.trainer_class}"
        print(f"{command}: training{trained} on {where}", flush=True)
    trainer = build_trainer(script_args, training_args, model_args)
    accelerator = trainer.accelerator
    if prepare is not None:
        prepare(trainer)
    resume_from_checkpoint = training_args.resume_from_checkpoint
    try:
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    except ValueError as error:
        if resume_from_checkpoint is None or not raised_while_resuming(error):
            raise
        raise CliError(f"resume_from_checkpoint: {error}") from error
    trainer.save_model(training_args.output_dir)
    accelerator.print(f"{command}: model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    # Every process waits for all (a barrier), then ends its trackers and process group (`Trainer.end`): no process
    # tears its group down while another still works in it, whose gloo group would then wait in its destructor forever.
    if end:
        accelerator.wait_for_everyone()
        trainer.end()
    return trainer


def config_file_over_defaults(parser: LoptiParser, training_args) -> str | None:
    """
    What a config file or preset sets over the defaults of a user's config class (a preset is written for the
    command's own config): the fields whose values differ from the class's defaults, each one that replaces a
    default the class chose itself (`epsilon 0.4 -> 0.2` over `GMPOConfig`'s), and the values left out; `None` for
    the command's own config, or without a config file.

    Args:
        parser (`LoptiParser`): the parser that read the file.
        training_args (`LoptiArguments`): the config it built.
    """
    config_class = type(training_args)
    stock_config = CONFIGS[parser.trainer]
    if parser.config is None or config_class is stock_config:
        return None
    defaults = field_defaults(config_class)
    stock_defaults = field_defaults(stock_config)
    from_file = [name for name, source in parser.sources.items() if source == "config_file" and name in defaults]
    differ = [name for name in from_file if getattr(training_args, name) != defaults[name]]
    own = [name for name in differ if defaults[name] != stock_defaults.get(name, dataclasses.MISSING)]
    changes = ", ".join(f"{name} {defaults[name]!r} -> {getattr(training_args, name)!r}" for name in own)
    replaced = f"its own defaults replaced: {changes}" if own else "no default of its own replaced"
    left_out = ""
    if parser.left_out:
        values = ", ".join(f"{name} {value!r}" for name, value in parser.left_out.items())
        left_out = f"; left out, at {stock_config.__name__}'s defaults, which {config_class.__name__} lacks: {values}"
    return (
        f"{parser.prog}: {parser.config} sets {len(differ)} fields over {config_class.__name__}'s defaults "
        f"({', '.join(differ)}); {replaced}{left_out}"
    )


def checked_args(argv: Sequence[str], trainer: str, added: dict[str, Any] | None = None) -> tuple:
    """`(script_args, training_args, model_args, what --dry_run prints)` for `trl-lopti TRAINER ARGV`, checked before
    anything loads ([`parse_train_args`])."""
    parser = train_parser(trainer, argv)
    script_args, training_args, model_args = parse_train_args(argv, trainer, added, parser)
    # Once under a launcher.
    if os.environ.get("RANK", "0") == "0":
        said = config_file_over_defaults(parser, training_args)
        if said:
            print(said, file=sys.stderr)
    try:
        check_model_args(model_args)
        resolve_checkpoint(training_args)
        check_trainer_accepts(run_trainer_class(script_args, training_args), training_args)
        resolved = resolved_config(parser, script_args, training_args, model_args)
    except CliError as error:
        raise CliError(parser.where(str(error))) from error
    return script_args, training_args, model_args, resolved
