"""`trl-lopti train`: like `trl grpo`, with Advantage Reweighting and Lopti, from a YAML config and/or flags.

```bash
trl-lopti train --config configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml            # a paper preset
trl-lopti train --config my.yaml --learning_rate 2e-6 --lopti_threshold None     # CLI overrides the YAML
trl-lopti train --config my.yaml --dry_run                                       # parse, validate, print; no model
accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m trl_lopti train --config my.yaml
```

Parsing is TRL's [`~trl.TrlParser.parse_args_and_config`], as in `trl/scripts/grpo.py`: the same YAML keys as `trl grpo`
where they exist, i.e. every field of [`LoptiGRPOConfig`] (TRL's `GRPOConfig` plus `advantage_reweighting_alpha`,
`lopti_threshold`, `lopti_order`), TRL's [`~trl.ModelConfig`] (`model_name_or_path`, `dtype`, `use_peft`, `lora_r`, ...)
and [`LoptiScriptArguments`] (the task, the dataset and the reward functions). Its errors are turned into a
[`~trl_lopti.cli.errors.CliError`] that names the config file or the field.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from trl import ScriptArguments

from . import rehearse
from .errors import CliError
from .parsing import LoptiTrlParser, parse_with_config
from .train_inputs import REWARD_FUNCS, build_datasets, dataset_spec, resolve_model, resolve_reward_funcs


TASKS = ("knights_knaves", "math", "dataset")
"""Values of `--task`."""


@dataclass
class LoptiScriptArguments(ScriptArguments):
    r"""
    Script arguments of `trl-lopti train`: which task to train on and how to build its dataset and reward.

    Args:
        task (`str`, *optional*, defaults to `"knights_knaves"`):
            `"knights_knaves"` (the paper's logic puzzles: generated offline, or the published set when
            `dataset_name` is given), `"math"` (a math set graded by the authors' rules, `math_reward`) or
            `"dataset"` (any dataset with a `prompt` column, by hub name or local path, with `reward_funcs`).
        dataset_name (`str`, *optional*):
            `knights_knaves`: hub id or local copy of the published K&K data (`K-and-K/knights-and-knaves`); unset:
            puzzles are generated. `math`: a short name of `trl_lopti.tasks.MATH_DATASETS` (e.g. `"deepscaler"`), a
            hub id, or a local `.json`/`.jsonl`/`.parquet`/`.csv` file. `dataset`: hub id, local data file, local folder
            of data files or a folder written by `Dataset.save_to_disk`.
        reward_funcs (`list[str]`, *optional*):
            Reward functions: names of [`REWARD_FUNCS`] or dotted import paths. Defaults to the task's reward
            (`knights_knaves_reward`, `math_reward`); required for `task: dataset`.
        kk_num_people (`list[int]`, *optional*, defaults to `[3]`):
            K&K puzzle sizes (2 to 8); several give a mixture (the paper trains on `[3, 4, 5, 6, 7]`).
        kk_num_samples (`int`, *optional*, defaults to `1000`):
            Number of generated K&K training puzzles (ignored when `dataset_name` is set).
        kk_num_eval_samples (`int`, *optional*, defaults to `100`):
            Number of generated K&K evaluation puzzles, distinct from the training ones (used when
            `eval_strategy` is not `"no"`).
        kk_seed (`int`, *optional*, defaults to `0`):
            Seed of the K&K generator.
        kk_prefill_think (`bool`, *optional*, defaults to `True`):
            End each K&K prompt with an assistant `"<think>"` that the model continues, as the paper does.
        kk_source (`str`, *optional*):
            `"paper"`: the authors' puzzles, split (train 4,500 / test 500) and exact prompt text
            (`trl_lopti.tasks.knights_knaves.load_knights_knaves_dataset(source="paper")`); evaluation uses
            `dataset_test_split` (`"test"`). Unset: the published set when `dataset_name` is given, else generated.
        kk_data_dir (`str`, *optional*):
            `kk_source: paper`: a local folder laid out as `{3..7}ppl/{train,test}.parquet` (default: the authors'
            files by URL).
        math_data_file (`str`, *optional*):
            `math` with `dataset_name` one of `trl_lopti.tasks.math.PAPER_MATH_FILES` (e.g. `"dsr_uniform"`): a local
            copy of that file (default: the authors' file by URL).
        math_problem_column (`str`, *optional*, defaults to `"problem"`):
            `math` from a hub id or file: column with the problem.
        math_answer_column (`str`, *optional*, defaults to `"answer"`):
            `math` from a hub id or file: column with the reference answer.
        max_train_samples (`int`, *optional*):
            Keep only the first this many training rows (after shuffling with `kk_seed` for `math`/`dataset`).
        dry_run (`bool`, *optional*, defaults to `False`):
            Parse and validate everything, print the resolved configuration and the dataset spec, and exit without
            loading a model or a dataset.
        rehearse (`bool`, *optional*, defaults to `False`):
            On the command line: rehearse the run offline with a tiny model, on CPU processes without a GPU
            (`trl_lopti.cli.rehearse`).
    """

    task: str = field(
        default="knights_knaves",
        metadata={"help": "Task: 'knights_knaves', 'math' or 'dataset'.", "choices": list(TASKS)},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Reward functions: any of {sorted(REWARD_FUNCS)} or a dotted import path "
            "('my_module.my_reward'). Defaults to the task's reward; required for task 'dataset'."
        },
    )
    kk_num_people: list[int] = field(
        default_factory=lambda: [3],
        metadata={"help": "Knights & Knaves puzzle sizes (2-8); several give a mixture, e.g. 3 4 5 6 7."},
    )
    kk_num_samples: int = field(
        default=1000, metadata={"help": "Number of generated K&K training puzzles (when dataset_name is unset)."}
    )
    kk_num_eval_samples: int = field(
        default=100, metadata={"help": "Number of generated K&K evaluation puzzles (when evaluation is on)."}
    )
    kk_seed: int = field(default=0, metadata={"help": "Seed of the K&K generator and of data shuffling."})
    kk_prefill_think: bool = field(
        default=True, metadata={"help": "End each K&K prompt with an assistant '<think>' (as the paper does)."}
    )
    kk_source: str | None = field(
        default=None,
        metadata={
            "help": "K&K data: 'paper' (the authors' split and prompt text), 'hub' or 'generated'; unset: 'hub' when "
            "dataset_name is set, else 'generated'.",
            "choices": ["paper", "hub", "generated"],
        },
    )
    kk_data_dir: str | None = field(
        default=None, metadata={"help": "kk_source 'paper': local folder with {3..7}ppl/{train,test}.parquet."}
    )
    math_data_file: str | None = field(
        default=None, metadata={"help": "Math paper sets (e.g. dataset_name 'dsr_uniform'): a local copy of the file."}
    )
    math_problem_column: str = field(
        default="problem", metadata={"help": "Math from a hub id or a file: column with the problem."}
    )
    math_answer_column: str = field(
        default="answer", metadata={"help": "Math from a hub id or a file: column with the reference answer."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only this many training rows (None: all)."}
    )
    dry_run: bool = field(
        default=False,
        metadata={"help": "Parse and validate, print the resolved configuration and exit without loading a model."},
    )
    rehearse: bool = field(
        default=False, metadata={"help": "Rehearse the run offline: tiny model, one Lopti cycle, save and resume."}
    )

    def __post_init__(self):
        if self.task not in TASKS:
            raise CliError(f"task: unknown task {self.task!r}; choose one of {list(TASKS)}")
        if isinstance(self.kk_num_people, int):
            self.kk_num_people = [self.kk_num_people]
        bad = [n for n in self.kk_num_people if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 8]
        if bad or not self.kk_num_people:
            raise CliError(f"kk_num_people: every size must be an integer from 2 to 8, got {self.kk_num_people!r}")
        for name in ("kk_num_samples", "kk_num_eval_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CliError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise CliError(f"max_train_samples: must be a positive integer or None, got {self.max_train_samples!r}")
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = [self.reward_funcs]
        if self.task == "dataset":
            if not self.dataset_name:
                raise CliError("dataset_name: required for task 'dataset' (a hub id or a local path)")
            if not self.reward_funcs:
                raise CliError(
                    f"reward_funcs: required for task 'dataset' (names from {sorted(REWARD_FUNCS)} or dotted paths)"
                )
        if self.kk_source not in (None, "paper", "hub", "generated"):
            raise CliError(f"kk_source: must be 'paper', 'hub', 'generated' or unset, got {self.kk_source!r}")
        if self.task == "math" and not self.dataset_name:
            raise CliError(
                "dataset_name: required for task 'math' (e.g. 'deepscaler', a hub id, or a local .jsonl/.parquet file)"
            )
        if self.dataset_streaming:
            raise CliError("dataset_streaming: streaming datasets are not supported by trl-lopti train")


# ---------------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------------
def make_parser(prog: str | None = "trl-lopti train") -> LoptiTrlParser:
    """
    Returns the TRL parser of `trl-lopti train`.

    Args:
        prog (`str`, *optional*, defaults to `"trl-lopti train"`):
            Program name shown in `--help`.

    Returns:
        [`LoptiTrlParser`]: Parses into `(LoptiScriptArguments, LoptiGRPOConfig, trl.ModelConfig)`.
    """
    from trl import ModelConfig

    from ..config import LoptiGRPOConfig

    return LoptiTrlParser((LoptiScriptArguments, LoptiGRPOConfig, ModelConfig), prog=prog)


def parse_train_args(argv: Sequence[str]):
    """
    Parses `trl-lopti train` arguments with TRL's parser: `--config FILE.yaml` supplies defaults, flags override them.

    Args:
        argv (`Sequence[str]`):
            The arguments after `train`.

    Returns:
        `tuple[LoptiScriptArguments, LoptiGRPOConfig, trl.ModelConfig]`: The parsed arguments; `script_args` also
        carries `config_path` and `explicit_fields` (the fields set in the file or on the command line).
    """
    args = list(argv)
    if ("--dry_run" in args or "--dry-run" in args) and not ("--use_cpu" in args or "--use-cpu" in args):
        _prefer_cpu_for_dry_run(args)
    parser = make_parser()
    script_args, training_args, model_args = parse_with_config(parser, args)
    explicit = set(parser.config_fields)
    explicit |= {arg[2:].split("=", 1)[0].replace("-", "_") for arg in args if arg.startswith("--")}
    script_args.config_path = args[args.index("--config") + 1] if "--config" in args else None
    script_args.explicit_fields = sorted(explicit)
    return script_args, training_args, model_args


def _prefer_cpu_for_dry_run(args: list[str]) -> None:
    """A dry run validates GPU presets on a machine without a GPU: `bf16` needs `use_cpu` there."""
    import torch

    if not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())):
        args += ["--use_cpu", "true"]
        print("trl-lopti: dry run without a GPU: validating with use_cpu=True", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------------------
# Dry run and training
# ---------------------------------------------------------------------------------------------------------------------
def _non_default_fields(obj) -> dict[str, Any]:
    changed = {}
    for f in fields(obj):
        if not f.init:
            continue
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = MISSING
        value = getattr(obj, f.name, None)
        if default is MISSING or value != default:
            changed[f.name] = value
    return changed


def resolved_config(script_args, training_args, model_args) -> dict[str, Any]:
    """
    The configuration of a run as a JSON-ready dict: what `--dry_run` prints.

    Returns:
        `dict[str, Any]`: `config_file`, `task`, `dataset`, `reward_funcs`, `model`, `lopti`, `training` (the
        `LoptiGRPOConfig` fields set in the config file or on the command line, as resolved) and `derived` (batch
        sizes the config computes).
    """
    from trl import get_peft_config

    model = resolve_model(model_args.model_name_or_path)
    model.update({k: v for k, v in _non_default_fields(model_args).items() if k != "model_name_or_path"})
    peft_config = get_peft_config(model_args)
    if peft_config is not None:
        model["peft"] = {"type": type(peft_config).__name__, "r": peft_config.r, "lora_alpha": peft_config.lora_alpha}
    from ..config import LOPTI_FIELD_NAMES

    training_field_names = {f.name for f in fields(training_args)}
    return {
        "config_file": getattr(script_args, "config_path", None),
        "task": script_args.task,
        "dataset": dataset_spec(script_args, training_args),
        "reward_funcs": [name for name, _ in resolve_reward_funcs(script_args)],
        "model": model,
        "lopti": {name: getattr(training_args, name) for name in LOPTI_FIELD_NAMES},
        "training": {
            name: getattr(training_args, name)
            for name in getattr(script_args, "explicit_fields", [])
            if name in training_field_names
        },
        "derived": {
            name: getattr(training_args, name, None)
            for name in ("generation_batch_size", "steps_per_generation", "num_generations", "world_size")
        },
    }


def main(argv: Sequence[str]) -> int:
    """
    `trl-lopti train`: parse, build the task and train with [`LoptiGRPOTrainer`].

    Args:
        argv (`Sequence[str]`):
            Arguments after `train`, e.g. `["--config", "preset.yaml", "--learning_rate", "2e-6"]`.

    Returns:
        `int`: The exit code.
    """
    if any(arg.startswith("--rehearse") for arg in argv):  # before parsing: it sets up the launcher's backend first
        return rehearse.main(list(argv))
    script_args, training_args, model_args = parse_train_args(argv)
    if script_args.dry_run:
        print(json.dumps(resolved_config(script_args, training_args, model_args), indent=2, default=str))
        return 0
    run_training(script_args, training_args, model_args)
    return 0


def policy_model_init_kwargs(training_args, model_args) -> dict[str, Any]:
    """
    The keyword arguments with which TRL loads the policy (and the reference model) from `model_name_or_path`: the
    model's `dtype`, revision and attention implementation, then the config's own `model_init_kwargs` on top.

    Args:
        training_args ([`LoptiGRPOConfig`]):
            Training configuration (`trust_remote_code`, `model_init_kwargs`).
        model_args (`trl.ModelConfig`):
            Model settings (`dtype`, `model_revision`, `attn_implementation`).

    Returns:
        `dict[str, Any]`: What `run_training` sets as `training_args.model_init_kwargs`.
    """
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    model_init_kwargs = {key: value for key, value in model_init_kwargs.items() if value is not None}
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    return model_init_kwargs


def run_training(script_args, training_args, model_args, end: bool = True):
    """
    Builds the dataset, the rewards and a [`LoptiGRPOTrainer`], then trains and saves, like `trl grpo`.

    Args:
        script_args ([`LoptiScriptArguments`]):
            Task, dataset and reward functions.
        training_args ([`LoptiGRPOConfig`]):
            Training configuration.
        model_args (`trl.ModelConfig`):
            Model, dtype and LoRA settings.
        end (`bool`, *optional*, defaults to `True`):
            Finish the trackers and the process group (`False`: this process trains again, as `--rehearse` does).

    Returns:
        [`LoptiGRPOTrainer`]: The trainer after training.
    """
    from trl import get_peft_config, get_quantization_config

    from .. import LoptiGRPOTrainer

    model = resolve_model(model_args.model_name_or_path)
    reward_funcs = [func for _, func in resolve_reward_funcs(script_args)]
    training_args.model_init_kwargs = policy_model_init_kwargs(training_args, model_args)

    train_dataset, eval_dataset = build_datasets(script_args, training_args)
    if script_args.task == "knights_knaves" and script_args.kk_prefill_think:
        # GRPOTrainer never continues a final assistant message: give it the "<think>"-prefilled prompts as text.
        from transformers import AutoTokenizer

        from ..tasks.knights_knaves import render_prompts_as_text

        tokenizer = AutoTokenizer.from_pretrained(
            model["model_name_or_path"], trust_remote_code=training_args.trust_remote_code
        )
        train_dataset = render_prompts_as_text(train_dataset, tokenizer)
        if eval_dataset is not None:
            eval_dataset = render_prompts_as_text(eval_dataset, tokenizer)
    kwargs = {}
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    trainer = LoptiGRPOTrainer(
        model=model["model_name_or_path"],
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
        **kwargs,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"trl-lopti: model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if end and hasattr(trainer, "end"):
        trainer.end()
    return trainer
