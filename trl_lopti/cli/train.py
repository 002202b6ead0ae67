"""`trl-lopti train`: TRL's `trl/scripts/grpo.py` with [`LoptiGRPOTrainer`] and the paper's tasks.

```bash
trl-lopti train --config configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml            # a paper preset
trl-lopti train --config my.yaml --learning_rate 2e-6 --lopti_threshold None     # flags override the YAML
trl-lopti train --config my.yaml --dry_run                                       # parse, validate, print; no model
accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m trl_lopti train --config my.yaml
```

The keys are those of `trl grpo` ([`LoptiGRPOConfig`]: TRL's `GRPOConfig` plus the AR and Lopti fields; TRL's
`ModelConfig`) and of [`LoptiScriptArguments`] (TRL's `ScriptArguments` plus the task and its reward functions).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

from trl import ScriptArguments

from .errors import CliError
from .parsing import check_model_name_or_path, parse_with_config


TASKS = ("knights_knaves", "math", "dataset")
"""Values of `task`."""

REWARD_FUNCS = {
    "knights_knaves_reward": "trl_lopti.tasks.knights_knaves.knights_knaves_reward",
    "knights_knaves_format_reward": "trl_lopti.tasks.knights_knaves.knights_knaves_format_reward",
    "knights_knaves_answer_reward": "trl_lopti.tasks.knights_knaves.knights_knaves_answer_reward",
    "math_reward": "trl_lopti.tasks.math.math_reward",
    "math_reward_lenient": "trl_lopti.tasks.math.math_reward_lenient",
    "accuracy_reward": "trl.rewards.accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards.reasoning_accuracy_reward",
    "think_format_reward": "trl.rewards.think_format_reward",
}
"""Reward functions known by name to `reward_funcs`; any dotted import path (`my_module.my_reward`) works too."""

DEFAULT_REWARD_FUNCS = {"knights_knaves": ["knights_knaves_reward"], "math": ["math_reward"], "dataset": []}


@dataclass
class LoptiScriptArguments(ScriptArguments):
    r"""
    Script arguments of `trl-lopti train`: TRL's `ScriptArguments` (`dataset_name`, `dataset_config`,
    `dataset_train_split`, `dataset_test_split`) plus the task and its reward functions. The evaluation set (when
    `eval_strategy` is not `"no"`) is `dataset_test_split`.

    Args:
        task (`str`, *optional*, defaults to `"knights_knaves"`):
            `"knights_knaves"` (the paper's logic puzzles, see `kk_source`), `"math"` (`dataset_name` one of
            `trl_lopti.tasks.math.PAPER_MATH_FILES`, the authors' files such as `"dsr_uniform"`, or of
            `MATH_DATASETS`, such as `"deepscaler"`; graded by the authors' rules) or `"dataset"` (`dataset_name` a hub
            id, a data file, a folder of data files or a `save_to_disk` folder, with a `prompt` column).
        reward_funcs (`list[str]`, *optional*):
            Names of [`REWARD_FUNCS`] or dotted import paths. Defaults to the task's reward.
        kk_source (`str`, *optional*):
            `"paper"` (the authors' puzzles, split and exact prompt text, from `kk_data_dir` or their repository),
            `"hub"` (`dataset_name`, default `K-and-K/knights-and-knaves`) or `"generated"` (`kk_num_samples` and
            `kk_num_eval_samples` new puzzles). Unset: `"hub"` when `dataset_name` is set, else `"generated"`.
        kk_num_people (`list[int]`, *optional*, defaults to `[3]`):
            K&K puzzle sizes (2 to 8; the paper's files hold 3 to 7); several give a mixture.
        kk_num_samples (`int`, *optional*, defaults to `1000`):
            Generated K&K training puzzles.
        kk_num_eval_samples (`int`, *optional*, defaults to `100`):
            Generated K&K evaluation puzzles, none of them a training puzzle.
        kk_seed (`int`, *optional*, defaults to `0`):
            Seed of the K&K generator.
        kk_prefill_think (`bool`, *optional*, defaults to `True`):
            End generated and hub K&K prompts with an assistant `"<think>"` to continue (the paper's always do).
        kk_data_dir (`str`, *optional*), math_data_file (`str`, *optional*):
            A local copy of the authors' files: K&K laid out as `{3..7}ppl/{train,test}.parquet`; the math file.
        dry_run (`bool`, *optional*, defaults to `False`):
            Parse and validate, print the resolved configuration and exit without loading a model or a dataset.
        rehearse (`bool`, *optional*, defaults to `False`):
            Rehearse the run offline with a tiny model, on CPU processes without a GPU (`trl_lopti.cli.rehearse`).
    """

    task: str = field(default="knights_knaves", metadata={"help": f"One of {list(TASKS)}."})
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": f"Names of {sorted(REWARD_FUNCS)} or dotted import paths; default: the task's."}
    )
    kk_source: str | None = field(
        default=None, metadata={"help": "K&K data: 'paper', 'hub' or 'generated' (unset: 'hub' with a dataset_name)."}
    )
    kk_num_people: list[int] = field(default_factory=lambda: [3], metadata={"help": "K&K puzzle sizes (2-8)."})
    kk_num_samples: int = field(default=1000, metadata={"help": "Generated K&K training puzzles."})
    kk_num_eval_samples: int = field(default=100, metadata={"help": "Generated K&K evaluation puzzles."})
    kk_seed: int = field(default=0, metadata={"help": "Seed of the K&K generator."})
    kk_prefill_think: bool = field(default=True, metadata={"help": "End K&K prompts with an assistant '<think>'."})
    kk_data_dir: str | None = field(default=None, metadata={"help": "kk_source 'paper': a local copy of the files."})
    math_data_file: str | None = field(default=None, metadata={"help": "A paper math set: a local copy of its file."})
    dry_run: bool = field(default=False, metadata={"help": "Print the resolved configuration; load no model."})
    rehearse: bool = field(default=False, metadata={"help": "Rehearse offline: tiny model, one Lopti cycle, resume."})

    def __post_init__(self):
        self.reward_funcs = [self.reward_funcs] if isinstance(self.reward_funcs, str) else self.reward_funcs
        self.kk_num_people = [self.kk_num_people] if isinstance(self.kk_num_people, int) else self.kk_num_people
        if self.task not in TASKS:
            raise ValueError(f"task: must be one of {list(TASKS)}, got {self.task!r}")
        if self.kk_source not in (None, "paper", "hub", "generated"):
            raise ValueError(f"kk_source: must be 'paper', 'hub', 'generated' or unset, got {self.kk_source!r}")
        if not self.kk_num_people or not all(isinstance(n, int) and 2 <= n <= 8 for n in self.kk_num_people):
            raise ValueError(f"kk_num_people: every size must be an integer from 2 to 8, got {self.kk_num_people!r}")
        from ..tasks.math import MATH_DATASETS, PAPER_MATH_FILES

        if self.task == "math" and self.dataset_name not in {**PAPER_MATH_FILES, **MATH_DATASETS}:
            raise ValueError(f"dataset_name: task 'math' takes one of {[*PAPER_MATH_FILES, *MATH_DATASETS]}")
        if self.task == "dataset" and not self.dataset_name:
            raise ValueError("dataset_name: required for task 'dataset' (a hub id or a local path)")
        if self.task == "dataset" and not self.reward_funcs:
            raise ValueError("reward_funcs: required for task 'dataset'")
        if self.dataset_streaming:
            raise ValueError("dataset_streaming: trl-lopti train does not stream datasets")


def make_parser():
    """The parser of `trl-lopti train`: TRL's `TrlParser` of `(LoptiScriptArguments, LoptiGRPOConfig, ModelConfig)`."""
    from trl import ModelConfig, TrlParser

    from ..config import LoptiGRPOConfig

    return TrlParser((LoptiScriptArguments, LoptiGRPOConfig, ModelConfig), prog="trl-lopti train")


def parse_train_args(argv: Sequence[str]) -> tuple:
    """`(LoptiScriptArguments, LoptiGRPOConfig, ModelConfig)` from `--config FILE.yaml` and flags, which override it."""
    import torch

    args = list(argv)
    if {"--dry_run", "--dry-run"} & set(args) and "--use_cpu" not in args and not torch.cuda.is_available():
        args += ["--use_cpu", "true"]  # a dry run validates the GPU presets (bf16) on a machine without a GPU
    return parse_with_config(make_parser(), args)


def resolve_reward_funcs(script_args: LoptiScriptArguments) -> dict[str, Callable]:
    """The reward functions of a run by name, imported as `trl/scripts/grpo.py` imports them."""
    funcs = {}
    for name in script_args.reward_funcs or DEFAULT_REWARD_FUNCS[script_args.task]:
        module_name, _, attribute = REWARD_FUNCS.get(name, name).rpartition(".")
        if not module_name:
            raise CliError(f"reward_funcs: {name!r} is neither one of {sorted(REWARD_FUNCS)} nor a dotted import path")
        sys.path.insert(0, os.getcwd())
        try:
            funcs[name] = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise CliError(f"reward_funcs: cannot import {name!r}: {error}") from error
    return funcs


def _non_default_fields(arguments) -> dict[str, Any]:
    values = {}
    for f in fields(arguments):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if f.init and getattr(arguments, f.name) != default:
            values[f.name] = getattr(arguments, f.name)
    return values


def resolved_config(script_args, training_args, model_args) -> dict[str, Any]:
    """
    What `--dry_run` prints: the reward functions, the AR and Lopti settings, and, for the script, model and training
    arguments, every field whose resolved value differs from its default.
    """
    from ..config import LOPTI_FIELD_NAMES

    return {
        "reward_funcs": list(resolve_reward_funcs(script_args)),
        "lopti": {name: getattr(training_args, name) for name in LOPTI_FIELD_NAMES},
        "script": _non_default_fields(script_args),
        "model": _non_default_fields(model_args),
        "training": _non_default_fields(training_args),
    }


def _load_split(name: str, config: str | None, split: str):
    """A split of a hub dataset or local folder of data files, all rows of a data file, or a `save_to_disk` folder."""
    import datasets

    path = Path(name).expanduser()
    if (path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file():
        saved = datasets.load_from_disk(str(path))
        return saved[split] if isinstance(saved, datasets.DatasetDict) else saved
    if path.is_file():  # the builder (json, parquet, csv, ...) follows from the file's extension
        return datasets.load_dataset(str(path.parent), data_files=path.name, split="train")
    return datasets.load_dataset(name, config, split=split)


def _knights_knaves_data(args: LoptiScriptArguments, with_eval: bool) -> tuple:
    from ..tasks.knights_knaves import KNIGHTS_KNAVES_HUB_ID, generate_dataset, load_knights_knaves_dataset

    source = args.kk_source or ("hub" if args.dataset_name else "generated")
    if source == "generated":
        total = args.kk_num_samples + (args.kk_num_eval_samples if with_eval else 0)
        puzzles = generate_dataset(args.kk_num_people, total, seed=args.kk_seed, prefill_think=args.kk_prefill_think)
        evaluation = puzzles.select(range(args.kk_num_samples, total)) if with_eval else None
        return puzzles.select(range(args.kk_num_samples)), evaluation
    options = {"data_dir": args.kk_data_dir} if source == "paper" else {
        "path": args.dataset_name or KNIGHTS_KNAVES_HUB_ID, "prefill_think": args.kk_prefill_think}  # fmt: skip
    load = partial(load_knights_knaves_dataset, args.kk_num_people, source=source, **options)
    return load(split=args.dataset_train_split), load(split=args.dataset_test_split) if with_eval else None


def _math_data(args: LoptiScriptArguments, with_eval: bool) -> tuple:
    from ..tasks import math as math_task

    name, test_split = args.dataset_name, args.dataset_test_split
    if name in math_task.PAPER_MATH_FILES:  # the authors' files: the evaluation set is another of them
        evaluation = math_task.load_paper_math_dataset(test_split) if with_eval else None
        return math_task.load_paper_math_dataset(name, args.math_data_file), evaluation
    return math_task.load_math_dataset(name), math_task.load_math_dataset(test_split) if with_eval else None


def _any_data(args: LoptiScriptArguments, with_eval: bool) -> tuple:
    load = partial(_load_split, args.dataset_name, args.dataset_config)
    return load(args.dataset_train_split), load(args.dataset_test_split) if with_eval else None


def build_datasets(script_args: LoptiScriptArguments, training_args) -> tuple:
    """The task's training set and, when `eval_strategy` is not `"no"`, its evaluation set (else `None`)."""
    task_data = {"knights_knaves": _knights_knaves_data, "math": _math_data, "dataset": _any_data}[script_args.task]
    try:
        train, evaluation = task_data(script_args, training_args.eval_strategy != "no")
    except (OSError, ValueError) as error:
        raise CliError(f"cannot load the {script_args.task} data: {error}") from error
    if "prompt" not in train.column_names:
        raise CliError(f"dataset_name: the training data has no 'prompt' column (columns: {train.column_names})")
    return train, evaluation


def policy_model_init_kwargs(training_args, model_args) -> dict[str, Any]:
    """How TRL loads the policy (and reference model) from the path, as `trl/scripts/grpo.py` sets it."""
    model_init_kwargs = {"revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code,
                         "attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype}  # fmt: skip
    return {**model_init_kwargs, **(training_args.model_init_kwargs or {})}


def run_training(script_args, training_args, model_args, end: bool = True):
    """Builds the datasets, the rewards and a [`LoptiGRPOTrainer`], then trains and saves as `trl grpo` does (`end`:
    finish the trackers and the process group; a rehearsal trains twice in one process)."""
    from transformers import AutoTokenizer
    from trl import get_peft_config, get_quantization_config

    from .. import LoptiGRPOTrainer
    from ..tasks.knights_knaves import render_prompts_as_text

    reward_funcs = list(resolve_reward_funcs(script_args).values())
    training_args.model_init_kwargs = policy_model_init_kwargs(training_args, model_args)
    train_dataset, eval_dataset = build_datasets(script_args, training_args)
    if script_args.task == "knights_knaves" and script_args.kk_prefill_think:
        # GRPOTrainer never continues a final assistant message: give it the "<think>"-prefilled prompts as text.
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                                  trust_remote_code=training_args.trust_remote_code)  # fmt: skip
        train_dataset = render_prompts_as_text(train_dataset, tokenizer)
        eval_dataset = render_prompts_as_text(eval_dataset, tokenizer) if eval_dataset is not None else None
    trainer = LoptiGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"trl-lopti: model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if end:
        trainer.end()
    return trainer


def main(argv: Sequence[str]) -> int:
    """`trl-lopti train`: parse, check, then print the resolved configuration (`--dry_run`) or train."""
    if any(arg.startswith("--rehearse") for arg in argv):  # before parsing: it sets up the launcher's backend first
        from . import rehearse

        return rehearse.main(list(argv))
    script_args, training_args, model_args = parse_train_args(argv)
    check_model_name_or_path(model_args.model_name_or_path)
    resolved = resolved_config(script_args, training_args, model_args)  # imports the reward functions
    if script_args.dry_run:
        print(json.dumps(resolved, indent=2, default=str))
        return 0
    run_training(script_args, training_args, model_args)
    return 0
