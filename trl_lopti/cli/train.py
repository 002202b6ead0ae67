"""`trl-lopti train --config FILE.yaml [--flag value ...]`: TRL's `trl/scripts/grpo.py` with [`LoptiGRPOTrainer`], or
its `rloo.py` with [`LoptiRLOOTrainer`] (`trainer: rloo`), and the paper's tasks. The keys: the trainer's config
([`LoptiGRPOConfig`] or [`LoptiRLOOConfig`]), TRL's `ModelConfig` and [`LoptiScriptArguments`]."""

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import datasets
import torch
import yaml
from transformers import AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from .. import tasks
from ..config import LoptiGRPOConfig, LoptiRLOOConfig, lopti_field_names
from .parsing import CliError, check_model_name_or_path, on_cpu, parse_with_config


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

TRAINERS = {"grpo": LoptiGRPOConfig, "rloo": LoptiRLOOConfig}
"""The trainers of `trl-lopti train` (values of `trainer`) and the config whose keys each reads."""

DEFAULT_REWARD_FUNCS = {"knights_knaves": ["knights_knaves_reward"], "math": ["math_reward"], "dataset": []}
"""The tasks (values of `task`) and the reward functions of each when `reward_funcs` is unset."""


@dataclass
class LoptiScriptArguments(ScriptArguments):
    """Script arguments of `trl-lopti train`: TRL's `ScriptArguments` (`dataset_name`, `dataset_config`,
    `dataset_train_split`, `dataset_test_split`: the evaluation set when `eval_strategy` is not `"no"`) plus these."""

    trainer: str = field(
        default="grpo",
        metadata={
            "help": "'grpo' (LoptiGRPOTrainer) or 'rloo' (LoptiRLOOTrainer): the training keys are its config's.",
            "choices": list(TRAINERS),
        },
    )
    task: str = field(
        default="knights_knaves",
        metadata={
            "help": "'knights_knaves' (see kk_source), 'math' (dataset_name: a key of trl_lopti.tasks.math's "
            "PAPER_MATH_FILES or MATH_DATASETS) or 'dataset' (dataset_name: a hub id, a data file or a folder)."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Names of REWARD_FUNCS or dotted import paths (default: the task's reward)."}
    )
    kk_source: str | None = field(
        default=None,
        metadata={
            "help": "K&K data: 'paper' (the authors' split and prompts, from kk_data_dir or their repository), 'hub' "
            "(dataset_name, default K-and-K/knights-and-knaves) or 'generated' (kk_num_samples and "
            "kk_num_eval_samples puzzles from kk_seed). Unset: 'hub' with a dataset_name, else 'generated'."
        },
    )
    kk_num_people: list[int] = field(
        default_factory=lambda: [3], metadata={"help": "K&K puzzle sizes (2-8; the paper's: 3-7); several: a mixture."}
    )
    kk_num_samples: int = field(default=1000, metadata={"help": "Generated K&K training puzzles."})
    kk_num_eval_samples: int = field(default=100, metadata={"help": "Generated K&K evaluation puzzles."})
    kk_seed: int = field(default=0, metadata={"help": "Seed of the K&K generator."})
    kk_prefill_think: bool = field(default=True, metadata={"help": "End K&K prompts with an assistant '<think>'."})
    kk_data_dir: str | None = field(
        default=None, metadata={"help": "kk_source 'paper': a local copy, laid out as {3..7}ppl/{train,test}.parquet."}
    )
    math_data_file: str | None = field(default=None, metadata={"help": "A paper math set: a local copy of its file."})
    dry_run: bool = field(default=False, metadata={"help": "Print the resolved configuration; load no model."})
    rehearse: bool = field(default=False, metadata={"help": "Rehearse offline: tiny model, one Lopti cycle, resume."})

    def __post_init__(self):
        self.reward_funcs = [self.reward_funcs] if isinstance(self.reward_funcs, str) else self.reward_funcs
        self.kk_num_people = [self.kk_num_people] if isinstance(self.kk_num_people, int) else self.kk_num_people
        if self.task not in DEFAULT_REWARD_FUNCS:
            raise ValueError(f"task: must be one of {list(DEFAULT_REWARD_FUNCS)}, got {self.task!r}")
        if self.kk_source not in (None, "paper", "hub", "generated"):
            raise ValueError(f"kk_source: must be 'paper', 'hub', 'generated' or unset, got {self.kk_source!r}")
        if not self.kk_num_people or not all(isinstance(n, int) and 2 <= n <= 8 for n in self.kk_num_people):
            raise ValueError(f"kk_num_people: every size must be an integer from 2 to 8, got {self.kk_num_people!r}")
        math_sets = [*tasks.PAPER_MATH_FILES, *tasks.MATH_DATASETS]
        if self.task == "math" and self.dataset_name not in math_sets:
            raise ValueError(f"dataset_name: task 'math' takes one of {math_sets}")
        if self.task == "dataset" and not (self.dataset_name and self.reward_funcs):
            raise ValueError(f"{'reward_funcs' if self.dataset_name else 'dataset_name'}: required for task 'dataset'")
        if self.dataset_streaming:
            raise ValueError("dataset_streaming: trl-lopti train does not stream datasets")


def trainer_of(argv: Sequence[str], grpo_only: str | None = None) -> str:
    """The `trainer` that `argv` chooses (`--trainer`, else the `--config` file's `trainer`, else `"grpo"`), read
    before parsing: it decides the config the parser reads. Raises a [`CliError`] on a key (or a value of a key with
    choices) that only another trainer's config takes, naming both configs, and on a trainer other than GRPO where
    `grpo_only` (why a command takes GRPO only) is given. A file that cannot be read is left to the parser to report."""
    args, given = list(argv), {}
    with contextlib.suppress(OSError, yaml.YAMLError, ValueError, IndexError):  # no --config, or a bad file
        config = yaml.safe_load(Path(args[args.index("--config") + 1]).read_text())
        given.update(config if isinstance(config, dict) else {})
    for arg, following in zip(args, [*args[1:], "--"], strict=False):  # flags override the file: `--key value`, `=`
        if arg.startswith("--") and arg != "--config":
            name, equals, value = arg[2:].partition("=")
            given[name.replace("-", "_")] = value if equals else None if following.startswith("--") else following
    trainer = given.get("trainer", "grpo")
    if trainer not in list(TRAINERS):  # (a list: a YAML value may be unhashable)
        raise CliError(f"trainer: must be one of {list(TRAINERS)}, got {trainer!r}")
    if grpo_only and trainer != "grpo":
        raise CliError(f"trainer: {trainer}: {grpo_only}, so it takes trainer: grpo only")
    own, name = {f.name: f.metadata.get("choices") for f in fields(TRAINERS[trainer])}, TRAINERS[trainer].__name__
    for other, config_class in TRAINERS.items():
        for key, choices in ((f.name, f.metadata.get("choices")) for f in fields(config_class) if f.name in given):
            where = f"{config_class.__name__} (trainer: {other}); {name} (trainer: {trainer})"
            if key not in own:
                raise CliError(f"{key}: a key of {where} has no such key")
            if own[key] and choices and given[key] not in own[key] and given[key] in choices:
                raise CliError(f"{key}: {given[key]!r} is a value of {where} takes {own[key]}")
    return trainer


def parse_train_args(argv: Sequence[str]) -> tuple:
    """`(LoptiScriptArguments, the config of [`trainer_of`], ModelConfig)` from `--config FILE.yaml` and flags."""
    args, trainer = list(argv), trainer_of(argv)
    if {"--dry_run", "--dry-run"} & set(args) and not torch.accelerator.is_available():
        args = on_cpu(args, "train --dry_run")  # a dry run validates the GPU presets (bf16) on any machine
    parser = TrlParser((LoptiScriptArguments, TRAINERS[trainer], ModelConfig), prog="trl-lopti train")
    if (parsed := parse_with_config(parser, args))[0].trainer != trainer:  # an abbreviated flag, which argparse takes
        raise CliError(f"trainer: write the flag out in full: --trainer {parsed[0].trainer}")
    return parsed


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


def resolved_config(script_args, training_args, model_args) -> dict[str, Any]:
    """What `--dry_run` prints: the trainer, the reward functions, the AR and Lopti settings, and the script, training
    and model arguments that differ from their defaults."""

    def changed(arguments) -> dict[str, Any]:
        defaults = {
            f.name: f.default_factory() if f.default_factory is not MISSING else f.default
            for f in fields(arguments)
            if f.init
        }
        return {name: getattr(arguments, name) for name in defaults if getattr(arguments, name) != defaults[name]}

    return {
        "trainer": script_args.trainer,
        "reward_funcs": list(resolve_reward_funcs(script_args)),
        "lopti": {name: getattr(training_args, name) for name in lopti_field_names(type(training_args))},
        "script": changed(script_args),
        "model": changed(model_args),
        "training": changed(training_args),
    }


def build_datasets(script_args: LoptiScriptArguments, training_args) -> tuple:
    """The task's training set and, when `eval_strategy` is not `"no"`, its evaluation set (else `None`)."""
    args, with_eval = script_args, training_args.eval_strategy != "no"
    kk_source = args.kk_source or ("hub" if args.dataset_name else "generated")
    if args.task == "knights_knaves" and kk_source == "generated":  # held out: the puzzles after the training ones
        total = args.kk_num_samples + (args.kk_num_eval_samples if with_eval else 0)
        puzzles = tasks.generate_dataset(
            args.kk_num_people, total, seed=args.kk_seed, prefill_think=args.kk_prefill_think
        )

    def load(split: str, train: bool):
        if args.task == "knights_knaves" and kk_source == "generated":
            return puzzles.select(range(args.kk_num_samples) if train else range(args.kk_num_samples, total))
        if args.task == "knights_knaves":
            return tasks.load_knights_knaves_dataset(
                args.kk_num_people,
                split,
                kk_source,
                args.kk_data_dir,
                args.dataset_name or tasks.KNIGHTS_KNAVES_HUB_ID,
                prefill_think=args.kk_prefill_think,
            )
        if args.task == "math":  # two math sets: dataset_name, and dataset_test_split to evaluate on
            name = args.dataset_name if train else split
            if name in tasks.PAPER_MATH_FILES:
                return tasks.load_paper_math_dataset(name, args.math_data_file if train else None)
            return tasks.load_math_dataset(name)
        path = Path(args.dataset_name).expanduser()
        if path.is_file():  # all its rows in either split; the builder (json, parquet, ...) follows from its extension
            return datasets.load_dataset(str(path.parent), data_files=path.name, split="train")
        return datasets.load_dataset(args.dataset_name, args.dataset_config, split=split)  # or a `save_to_disk` folder

    try:
        train = load(args.dataset_train_split, train=True)
        evaluation = load(args.dataset_test_split, train=False) if with_eval else None
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
    """The trainer of `trl-lopti train`, [`LoptiGRPOTrainer`] or [`LoptiRLOOTrainer`] (`trainer`); `trl-lopti
    diagnose`: on its first `num_train_prompts` prompts."""
    from .. import LoptiGRPOTrainer, LoptiRLOOTrainer

    training_args.model_init_kwargs = policy_model_init_kwargs(training_args, model_args)
    train_dataset, eval_dataset = build_datasets(script_args, training_args)
    if num_train_prompts is not None:
        train_dataset = train_dataset.select(range(min(num_train_prompts, len(train_dataset))))
    if script_args.task == "knights_knaves" and script_args.kk_prefill_think:
        # GRPO and RLOO never continue a final assistant message: give them the "<think>"-prefilled prompts as text.
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.model_name_or_path,
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
        )
        train_dataset = tasks.render_prompts_as_text(train_dataset, tokenizer)
        eval_dataset = tasks.render_prompts_as_text(eval_dataset, tokenizer) if eval_dataset is not None else None
    trainer_class = {"grpo": LoptiGRPOTrainer, "rloo": LoptiRLOOTrainer}[script_args.trainer]
    return trainer_class(
        model=model_args.model_name_or_path,
        reward_funcs=list(resolve_reward_funcs(script_args).values()),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )


def run_training(script_args, training_args, model_args, end: bool = True, prepare: Callable | None = None):
    """Trains and saves the trainer of [`build_trainer`] as `trl grpo` (`trl rloo`) does; `end`: then end its trackers
    and process group; `prepare`: called with the trainer before it trains."""
    trainer = build_trainer(script_args, training_args, model_args)
    if prepare is not None:
        prepare(trainer)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"trl-lopti: model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if end:
        trainer.end()
    return trainer


USAGE = """needs a config file or flags, e.g. a preset of configs/ (`--dry_run`: check it and print it, load no model):
  trl-lopti train --config configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml --dry_run
or a model, a task and training fields as flags (`trl-lopti train --help`: every field), e.g.
  trl-lopti train --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --task knights_knaves --output_dir out"""


def main(argv: Sequence[str]) -> int:
    """`trl-lopti train`: parse, check, then print the resolved configuration (`--dry_run`), rehearse or train."""
    if not argv:
        raise CliError(USAGE)
    if any(arg.startswith("--rehearse") for arg in argv):  # before parsing: it sets up the launcher's backend first
        return importlib.import_module(".rehearse", __package__).main(list(argv))
    script_args, training_args, model_args = parse_train_args(argv)
    check_model_name_or_path(model_args.model_name_or_path)
    resolved = resolved_config(script_args, training_args, model_args)  # imports the reward functions
    if script_args.dry_run:
        print(json.dumps(resolved, indent=2, default=str))
    else:
        run_training(script_args, training_args, model_args)
    return 0
