"""The `trl-lopti` command line: `train` (like `trl grpo`, with AR and Lopti), `demo` and `diagnose`.

```bash
trl-lopti train --config configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml            # a paper preset
trl-lopti train --config my.yaml --learning_rate 2e-6 --lopti_threshold None     # CLI overrides the YAML
trl-lopti train --config my.yaml --dry_run                                       # parse, validate, print; no model
accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m trl_lopti train --config my.yaml
trl-lopti demo                        # SmolLM2-135M-Instruct, offline, on CPU, with a before/after table
trl-lopti diagnose --help             # token-gradient diagnostics (see trl_lopti.diagnostics)
```

`train` parses, with TRL's [`~trl.TrlParser`], the same YAML keys as `trl grpo` where they exist: every field of
[`LoptiGRPOConfig`] (TRL's `GRPOConfig` plus `advantage_reweighting_alpha`, `lopti_threshold`, `lopti_order`), TRL's
[`~trl.ModelConfig`] (`model_name_or_path`, `dtype`, `use_peft`, `lora_r`, ...) and [`LoptiScriptArguments`] (the
task, the dataset and the reward functions).
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from trl import ScriptArguments


TASKS = ("knights_knaves", "math", "dataset")
"""Values of `--task`."""

_LOCAL_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

REWARD_FUNCS = {
    "knights_knaves_reward": "trl_lopti.tasks.knights_knaves:knights_knaves_reward",
    "knights_knaves_format_reward": "trl_lopti.tasks.knights_knaves:knights_knaves_format_reward",
    "knights_knaves_answer_reward": "trl_lopti.tasks.knights_knaves:knights_knaves_answer_reward",
    "math_reward": "trl_lopti.tasks.math:math_reward",
    "math_reward_lenient": "trl_lopti.tasks.math:math_reward_lenient",
    "accuracy_reward": "trl.rewards:accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards:reasoning_accuracy_reward",
    "think_format_reward": "trl.rewards:think_format_reward",
}
"""Reward functions known by name to `--reward_funcs`; any dotted import path (`my_module.my_reward`) works too."""

DEFAULT_REWARD_FUNCS = {"knights_knaves": ["knights_knaves_reward"], "math": ["math_reward"], "dataset": []}


class CliError(ValueError):
    """A user error on the command line or in a config file; `main` prints it without a traceback."""


@dataclass
class LoptiScriptArguments(ScriptArguments):
    r"""
    Script arguments of `trl-lopti train`: which task to train on and how to build its dataset and reward.

    Args:
        task (`str`, *optional*, defaults to `"knights_knaves"`):
            `"knights_knaves"` (the paper's logic puzzles: generated offline, or the published set when
            `dataset_name` is given), `"math"` (a math set with a `\\boxed{}` answer checked by `math-verify`) or
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
def make_parser(prog: str | None = "trl-lopti train"):
    """
    Returns the TRL parser of `trl-lopti train`.

    Args:
        prog (`str`, *optional*, defaults to `"trl-lopti train"`):
            Program name shown in `--help`.

    Returns:
        `trl.TrlParser`: Parses into `(LoptiScriptArguments, LoptiGRPOConfig, trl.ModelConfig)`.
    """
    from trl import ModelConfig, TrlParser

    from .config import LoptiGRPOConfig

    return TrlParser((LoptiScriptArguments, LoptiGRPOConfig, ModelConfig), prog=prog)


def _actions_by_dest(parser) -> dict[str, Any]:
    return {action.dest: action for action in parser._actions if action.dest != "help"}


def _coerce(key: str, value: Any, action, config_path: str) -> Any:
    """Converts a YAML value to the field's type (YAML reads `1e-6` as a string), with an error naming the key."""
    if value is None:
        return None
    converter = action.type
    if action.nargs in ("+", "*") and not isinstance(value, list):
        value = [value]
    if isinstance(value, list):
        items = [_coerce(key, item, _ScalarAction(converter, action.choices), config_path) for item in value]
        return items
    if isinstance(value, dict):
        return value
    if converter is not None and converter is not str and not isinstance(value, bool):
        try:
            if isinstance(value, str) or (converter is float and isinstance(value, int)):
                value = converter(value)
        except (TypeError, ValueError) as error:
            type_name = getattr(converter, "__name__", str(converter))
            raise CliError(f"{config_path}: {key}: cannot read {value!r} as {type_name} ({error})") from error
    elif converter is not None and converter not in (str, float, int) and isinstance(value, bool):
        value = converter(str(value))
    if action.choices is not None and value not in action.choices:
        raise CliError(f"{config_path}: {key}: {value!r} is not one of {list(action.choices)}")
    return value


@dataclass
class _ScalarAction:
    type: Any
    choices: Any
    nargs: Any = None


def load_config_file(config_path: str | os.PathLike, parser) -> dict[str, Any]:
    """
    Reads a `trl-lopti train` YAML file and checks it against the parser.

    Args:
        config_path (`str` or `os.PathLike`):
            The YAML file: a mapping of field names to values, optionally with an `env` mapping of environment
            variables to set (as in TRL).
        parser (`trl.TrlParser`):
            The parser from [`make_parser`].

    Returns:
        `dict[str, Any]`: The values, converted to the fields' types, without `env` (which is applied).
    """
    import yaml

    path = Path(config_path)
    if not path.is_file():
        raise CliError(f"--config: config file {str(config_path)!r} does not exist")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise CliError(f"--config: {config_path} is not valid YAML: {error}") from error
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise CliError(f"--config: {config_path} must contain a YAML mapping of field: value, got {type(config).__name__}")
    env = config.pop("env", None) or {}
    if not isinstance(env, dict):
        raise CliError(f"{config_path}: env: must be a mapping of environment variables, got {env!r}")
    for key, value in env.items():
        os.environ[str(key)] = str(value)

    actions = _actions_by_dest(parser)
    unknown = [key for key in config if key not in actions or key == "config"]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), list(actions), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise CliError(f"{config_path}: unknown field(s) {', '.join(hints)}")
    return {key: _coerce(key, value, actions[key], str(config_path)) for key, value in config.items()}


def parse_train_args(argv: Sequence[str]):
    """
    Parses `trl-lopti train` arguments: `--config FILE.yaml` supplies defaults, the other flags override them.

    Args:
        argv (`Sequence[str]`):
            The arguments after `train`.

    Returns:
        `tuple[LoptiScriptArguments, LoptiGRPOConfig, trl.ModelConfig]`: The parsed arguments.
    """
    parser = make_parser()
    args = list(argv)
    config_path = None
    if "--config" in args:
        index = args.index("--config")
        if index + 1 >= len(args) or args[index + 1].startswith("--"):
            raise CliError("--config: expected a path to a YAML file after --config")
        config_path = args[index + 1]
        del args[index : index + 2]
        values = load_config_file(config_path, parser)
        parser.set_defaults_with_config(**values)
    if "--dry_run" in args or "--dry-run" in args:
        _prefer_cpu_for_dry_run(args, parser)
    try:
        script_args, training_args, model_args = parser.parse_args_into_dataclasses(args=args)
    except CliError:
        raise
    except ValueError as error:
        where = f" (config file {config_path})" if config_path else ""
        raise CliError(f"{error}{where}") from error
    explicit = set(values) if config_path else set()
    explicit |= {arg[2:].split("=", 1)[0].replace("-", "_") for arg in args if arg.startswith("--")}
    script_args.config_path = config_path
    script_args.explicit_fields = sorted(explicit)
    return script_args, training_args, model_args


def _prefer_cpu_for_dry_run(args: list[str], parser) -> None:
    """A dry run validates GPU presets on a machine without a GPU: `bf16` needs `use_cpu` there."""
    if "--use_cpu" in args or "--use-cpu" in args:
        return
    try:
        import torch

        has_accelerator = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    except Exception:  # pragma: no cover - torch is a dependency
        has_accelerator = False
    if not has_accelerator and _actions_by_dest(parser)["use_cpu"].default is not True:
        args += ["--use_cpu", "true"]
        print("trl-lopti: dry run without a GPU: validating with use_cpu=True", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------------------
# Model, rewards and data
# ---------------------------------------------------------------------------------------------------------------------
def _looks_like_local_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or (os.sep != "/" and os.sep in name)
        or name.count("/") > 1
        or Path(name).suffix.lower() in {".gguf", ".safetensors", ".bin", ".pt", ".yaml", ".json"}
    )


def resolve_model(model_name_or_path: str | None) -> dict[str, str]:
    """
    Checks the model argument: an existing local folder, or a hub id.

    Args:
        model_name_or_path (`str` or `None`):
            `model_name_or_path` of `ModelConfig`.

    Returns:
        `dict[str, str]`: `{"model_name_or_path": ..., "source": "local" | "hub"}`.
    """
    if not model_name_or_path:
        raise CliError("model_name_or_path: required (a local model folder or a hub id such as Qwen/Qwen2.5-3B-Instruct)")
    path = Path(model_name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CliError(f"model_name_or_path: {model_name_or_path!r} is a file; give the model's folder")
        if not (path / "config.json").is_file():
            raise CliError(f"model_name_or_path: {model_name_or_path!r} has no config.json; is it a model folder?")
        return {"model_name_or_path": str(path), "source": "local"}
    if _looks_like_local_path(model_name_or_path):
        raise CliError(f"model_name_or_path: local path {model_name_or_path!r} does not exist")
    return {"model_name_or_path": model_name_or_path, "source": "hub"}


def _import_object(spec: str, what: str) -> Callable:
    module_name, _, attribute = spec.replace(":", ".").rpartition(".")
    if not module_name:
        raise CliError(f"{what}: {spec!r} is neither a known name nor a dotted import path")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise CliError(f"{what}: cannot import module {module_name!r} for {spec!r}: {error}") from error
    try:
        obj = getattr(module, attribute)
    except AttributeError as error:
        raise CliError(f"{what}: module {module_name!r} has no attribute {attribute!r}") from error
    if not callable(obj):
        raise CliError(f"{what}: {spec!r} is not callable")
    return obj


def resolve_reward_funcs(script_args: LoptiScriptArguments) -> list[tuple[str, Callable]]:
    """
    Resolves the reward functions of a run.

    Args:
        script_args ([`LoptiScriptArguments`]):
            The script arguments; `reward_funcs` unset means the task's default reward.

    Returns:
        `list[tuple[str, Callable]]`: `(name, function)` pairs in order.
    """
    names = script_args.reward_funcs or DEFAULT_REWARD_FUNCS[script_args.task]
    resolved = []
    for name in names:
        target = REWARD_FUNCS.get(name)
        if target is None and "." not in name:
            raise CliError(
                f"reward_funcs: unknown reward function {name!r}; choose from {sorted(REWARD_FUNCS)} or give a "
                "dotted import path such as my_module.my_reward"
            )
        resolved.append((name, _import_object(target or name, "reward_funcs")))
    return resolved


def _local_data(name: str) -> Path | None:
    path = Path(name).expanduser()
    if path.exists():
        return path
    if _looks_like_local_path(name) or Path(name).suffix.lower() in _LOCAL_FILE_BUILDERS:
        raise CliError(f"dataset_name: local path {name!r} does not exist")
    return None


def dataset_spec(script_args: LoptiScriptArguments, training_args=None) -> dict[str, Any]:
    """
    Describes, without loading anything, the dataset a run will use; validates local paths and names.

    Args:
        script_args ([`LoptiScriptArguments`]):
            The script arguments.
        training_args ([`LoptiGRPOConfig`], *optional*):
            Used to tell whether an evaluation set is needed.

    Returns:
        `dict[str, Any]`: `source` (`"generated"`, `"hub"`, `"local"`, `"math_registry"`, `"paper"`) and the loading
        parameters.
    """
    task = script_args.task
    wants_eval = training_args is not None and str(getattr(training_args, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO")
    spec: dict[str, Any] = {"task": task}
    if task == "knights_knaves":
        spec["num_people"] = list(script_args.kk_num_people)
        spec["prefill_think"] = script_args.kk_prefill_think
        if script_args.kk_source == "paper":  # the authors' split and prompt text, built by trl_lopti.tasks
            spec.update(source="paper", data_dir=script_args.kk_data_dir, prefill_think=True)
        elif script_args.kk_source == "hub" or (script_args.kk_source is None and script_args.dataset_name):
            name = script_args.dataset_name or "K-and-K/knights-and-knaves"
            local = _local_data(name)
            spec.update(source="local" if local else "hub", path=str(local or name),
                        subset=script_args.dataset_train_split)  # fmt: skip
        else:
            spec.update(source="generated", num_samples=script_args.kk_num_samples, seed=script_args.kk_seed)
            if wants_eval:
                spec["num_eval_samples"] = script_args.kk_num_eval_samples
    elif task == "math":
        from .tasks.math import MATH_DATASETS

        from .tasks.math import PAPER_MATH_FILES

        name = script_args.dataset_name
        if name in PAPER_MATH_FILES:  # the authors' parquet (raw-text prompts), built by trl_lopti.tasks
            spec.update(source="paper", name=name, data_file=script_args.math_data_file)
        elif name in MATH_DATASETS:
            registry = MATH_DATASETS[name]
            spec.update(source="math_registry", name=name, hub_id=registry.path, split=registry.split)
        else:
            local = _local_data(name)
            spec.update(
                source="local" if local else "hub", path=str(local or name), split=script_args.dataset_train_split,
                problem_column=script_args.math_problem_column, answer_column=script_args.math_answer_column,
            )  # fmt: skip
    else:
        local = _local_data(script_args.dataset_name)
        spec.update(source="local" if local else "hub", path=str(local or script_args.dataset_name),
                    config=script_args.dataset_config, split=script_args.dataset_train_split)  # fmt: skip
    if wants_eval and spec.get("source") != "generated":
        spec["eval_split"] = script_args.dataset_test_split
    if script_args.max_train_samples is not None:
        spec["max_train_samples"] = script_args.max_train_samples
    return spec


def _load_any(path_or_name: str, config: str | None, split: str):
    """Loads one split by hub id, local data file, local folder of files or `save_to_disk` folder."""
    import datasets

    path = Path(path_or_name).expanduser()
    if path.is_file():
        builder = _LOCAL_FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise CliError(f"dataset_name: {path_or_name!r}: unsupported file type (use {sorted(_LOCAL_FILE_BUILDERS)})")
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise CliError(f"dataset_name: {path_or_name!r} has no split {split!r}; it has {list(loaded)}")
            return loaded[split]
        return loaded
    return datasets.load_dataset(str(path) if path.is_dir() else path_or_name, config, split=split)


def build_datasets(script_args: LoptiScriptArguments, training_args=None):
    """
    Builds the training (and, when evaluation is on, evaluation) dataset of a run.

    Args:
        script_args ([`LoptiScriptArguments`]):
            The script arguments.
        training_args ([`LoptiGRPOConfig`], *optional*):
            Used to tell whether an evaluation set is needed.

    Returns:
        `tuple[datasets.Dataset, datasets.Dataset | None]`: Train and eval datasets, both with a `prompt` column.
    """
    spec = dataset_spec(script_args, training_args)
    wants_eval = "eval_split" in spec or "num_eval_samples" in spec
    train, evaluation = None, None
    if spec["source"] == "paper":
        from .tasks import build_task_datasets

        train, evaluation = build_task_datasets(
            spec["task"], "paper", with_eval=wants_eval, num_people=spec.get("num_people", ()),
            data_dir=spec.get("data_dir"), train_split=spec.get("name", "train"),
            eval_split=spec.get("eval_split", "test"), data_file=spec.get("data_file"),
        )  # fmt: skip
    elif spec["task"] == "knights_knaves":
        from .tasks.knights_knaves import generate_dataset, load_knights_knaves_dataset

        people = spec["num_people"]
        if spec["source"] == "generated":
            total = spec["num_samples"] + (spec.get("num_eval_samples", 0) if wants_eval else 0)
            full = generate_dataset(people, total, seed=spec["seed"], prefill_think=spec["prefill_think"])
            train = full.select(range(spec["num_samples"]))
            if wants_eval:
                evaluation = full.select(range(spec["num_samples"], total))
        else:
            train = load_knights_knaves_dataset(people, spec["subset"], "hub", path=spec["path"],
                                                prefill_think=spec["prefill_think"])  # fmt: skip
            if wants_eval:
                evaluation = load_knights_knaves_dataset(people, spec["eval_split"], "hub", path=spec["path"],
                                                         prefill_think=spec["prefill_think"])  # fmt: skip
    elif spec["task"] == "math":
        from .tasks.math import MathDatasetSpec, load_math_dataset

        if spec["source"] == "math_registry":
            train = load_math_dataset(spec["name"])
            if wants_eval:
                evaluation = load_math_dataset(spec["eval_split"])
        else:
            path = Path(spec["path"]).expanduser()
            math_spec = MathDatasetSpec(
                path=spec["path"], split=spec["split"], problem_column=spec["problem_column"],
                answer_column=spec["answer_column"], name=script_args.dataset_config,
            )  # fmt: skip
            data_files = str(path) if path.is_file() else None
            train = load_math_dataset(math_spec, data_files=data_files)
            if wants_eval:
                if spec["eval_split"] in _math_registry_names():
                    evaluation = load_math_dataset(spec["eval_split"])
                else:
                    evaluation = load_math_dataset(
                        MathDatasetSpec(**{**math_spec.__dict__, "split": spec["eval_split"]}), data_files=data_files
                    )
        if script_args.max_train_samples is not None:
            train = train.shuffle(seed=script_args.kk_seed)
    else:
        train = _load_any(spec["path"], spec["config"], spec["split"])
        if wants_eval:
            evaluation = _load_any(spec["path"], spec["config"], spec["eval_split"])
        if script_args.max_train_samples is not None:
            train = train.shuffle(seed=script_args.kk_seed)
    if "prompt" not in train.column_names:
        raise CliError(f"dataset_name: the training data has no 'prompt' column (columns: {train.column_names})")
    if script_args.max_train_samples is not None:
        train = train.select(range(min(script_args.max_train_samples, len(train))))
    return train, evaluation


def _math_registry_names() -> set[str]:
    from .tasks.math import MATH_DATASETS

    return set(MATH_DATASETS)


# ---------------------------------------------------------------------------------------------------------------------
# Commands
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
    training_field_names = {f.name for f in fields(training_args)}
    return {
        "config_file": getattr(script_args, "config_path", None),
        "task": script_args.task,
        "dataset": dataset_spec(script_args, training_args),
        "reward_funcs": [name for name, _ in resolve_reward_funcs(script_args)],
        "model": model,
        "lopti": {
            "advantage_reweighting_alpha": training_args.advantage_reweighting_alpha,
            "lopti_threshold": training_args.lopti_threshold,
            "lopti_order": training_args.lopti_order,
        },
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


def train_main(argv: Sequence[str]) -> int:
    """
    `trl-lopti train`: parse, build the task and train with [`LoptiGRPOTrainer`].

    Args:
        argv (`Sequence[str]`):
            Arguments after `train`, e.g. `["--config", "preset.yaml", "--learning_rate", "2e-6"]`.

    Returns:
        `int`: The exit code.
    """
    script_args, training_args, model_args = parse_train_args(argv)
    if script_args.dry_run:
        print(json.dumps(resolved_config(script_args, training_args, model_args), indent=2, default=str))
        return 0
    run_training(script_args, training_args, model_args)
    return 0


def run_training(script_args, training_args, model_args):
    """
    Builds the dataset, the rewards and a [`LoptiGRPOTrainer`], then trains and saves, like `trl grpo`.

    Args:
        script_args ([`LoptiScriptArguments`]):
            Task, dataset and reward functions.
        training_args ([`LoptiGRPOConfig`]):
            Training configuration.
        model_args (`trl.ModelConfig`):
            Model, dtype and LoRA settings.

    Returns:
        [`LoptiGRPOTrainer`]: The trainer after training.
    """
    from trl import get_peft_config, get_quantization_config

    from . import LoptiGRPOTrainer

    model = resolve_model(model_args.model_name_or_path)
    reward_funcs = [func for _, func in resolve_reward_funcs(script_args)]
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    model_init_kwargs = {key: value for key, value in model_init_kwargs.items() if value is not None}
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    train_dataset, eval_dataset = build_datasets(script_args, training_args)
    if script_args.task == "knights_knaves" and script_args.kk_prefill_think:
        # GRPOTrainer never continues a final assistant message: give it the "<think>"-prefilled prompts as text.
        from transformers import AutoTokenizer

        from .tasks.knights_knaves import render_prompts_as_text

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
    if hasattr(trainer, "end"):
        trainer.end()
    return trainer


def diagnose_command(argv: Sequence[str]) -> int:
    """`trl-lopti diagnose`: token-gradient diagnostics, see `trl_lopti.diagnostics`."""
    try:
        from .diagnostics import diagnose_main
    except ImportError as error:
        raise CliError(f"diagnose: trl_lopti.diagnostics is not available: {error}") from error
    return int(diagnose_main(list(argv)) or 0)


def demo_command(argv: Sequence[str]) -> int:
    """`trl-lopti demo`: see `trl_lopti.demo`."""
    from .demo import demo_main

    return int(demo_main(list(argv)) or 0)


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (train_main, "train with GRPO + AR + Lopti from a YAML config and/or flags (like `trl grpo`)"),
    "demo": (demo_command, "offline demo: SmolLM2-135M-Instruct trained on CPU, before/after table and curve"),
    "diagnose": (diagnose_command, "measure per-token gradients by probability quartile (the paper's analysis)"),
}


def _usage() -> str:
    lines = ["usage: trl-lopti {" + ",".join(COMMANDS) + "} [options]", "", "commands:"]
    lines += [f"  {name:<10}{help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "Run `trl-lopti COMMAND --help` for the options of a command.", "Other: --version"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """
    Entry point of the `trl-lopti` console script and of `python -m trl_lopti`.

    Args:
        argv (`Sequence[str]`, *optional*):
            Arguments without the program name; defaults to `sys.argv[1:]`.

    Returns:
        `int`: The exit code (0 on success, 2 on a usage or configuration error).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(f"trl-lopti {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"trl-lopti: error: unknown command {argv[0]!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return command[0](argv[1:])
    except CliError as error:
        print(f"trl-lopti {argv[0]}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
