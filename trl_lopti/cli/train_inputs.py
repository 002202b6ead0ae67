"""What `trl-lopti train` resolves before training: the model argument, the reward functions and the datasets.

Each dataset source is described once, by a [`DatasetPlan`]: the description `--dry_run` prints and the loader that
`build_datasets` calls come from the same branch.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CliError


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

_LOCAL_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


# ---------------------------------------------------------------------------------------------------------------------
# Model and rewards
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
        raise CliError(
            "model_name_or_path: required (a local model folder or a hub id such as Qwen/Qwen2.5-3B-Instruct)"
        )
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


def resolve_reward_funcs(script_args) -> list[tuple[str, Callable]]:
    """
    Resolves the reward functions of a run.

    Args:
        script_args ([`~trl_lopti.cli.train.LoptiScriptArguments`]):
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


# ---------------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class DatasetPlan:
    """
    The dataset of a run, described and loadable, built by one branch per source.

    Args:
        spec (`dict[str, Any]`):
            What `--dry_run` prints: `task`, `source` (`"generated"`, `"hub"`, `"local"`, `"math_registry"`,
            `"paper"`) and the loading parameters; `eval_split` or `num_eval_samples` when an evaluation set is needed.
        load (`Callable[[bool], tuple[datasets.Dataset, datasets.Dataset | None]]`):
            `load(with_eval)` returns the training set and, when `with_eval`, the evaluation set.
        shuffle_before_truncation (`bool`):
            Whether `max_train_samples` keeps a shuffled (seed `kk_seed`) rather than a leading part of the data.
    """

    spec: dict[str, Any]
    load: Callable[[bool], tuple[Any, Any]]
    shuffle_before_truncation: bool = True

    @property
    def wants_eval(self) -> bool:
        """Whether the run needs an evaluation set."""
        return "eval_split" in self.spec or "num_eval_samples" in self.spec


def _local_data(name: str) -> Path | None:
    path = Path(name).expanduser()
    if path.exists():
        return path
    if _looks_like_local_path(name) or Path(name).suffix.lower() in _LOCAL_FILE_BUILDERS:
        raise CliError(f"dataset_name: local path {name!r} does not exist")
    return None


def _load_any(path_or_name: str, config: str | None, split: str):
    """Loads one split by hub id, local data file, local folder of files or `save_to_disk` folder."""
    import datasets

    path = Path(path_or_name).expanduser()
    if path.is_file():
        builder = _LOCAL_FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            supported = sorted(_LOCAL_FILE_BUILDERS)
            raise CliError(f"dataset_name: {path_or_name!r}: unsupported file type (use {supported})")
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise CliError(f"dataset_name: {path_or_name!r} has no split {split!r}; it has {list(loaded)}")
            return loaded[split]
        return loaded
    return datasets.load_dataset(str(path) if path.is_dir() else path_or_name, config, split=split)


def _knights_knaves_plan(script_args, wants_eval: bool) -> DatasetPlan:
    from ..tasks import build_task_datasets
    from ..tasks.knights_knaves import KNIGHTS_KNAVES_HUB_ID

    people, prefill = list(script_args.kk_num_people), script_args.kk_prefill_think
    spec: dict[str, Any] = {"task": "knights_knaves", "num_people": people, "prefill_think": prefill}
    source = script_args.kk_source or ("hub" if script_args.dataset_name else "generated")
    options: dict[str, Any] = {"num_people": people, "prefill_think": prefill}
    if source == "paper":  # the authors' split and prompt text
        spec.update(source="paper", data_dir=script_args.kk_data_dir, prefill_think=True)
        options["data_dir"] = script_args.kk_data_dir
    elif source == "hub":
        name = script_args.dataset_name or KNIGHTS_KNAVES_HUB_ID
        local = _local_data(name)
        spec.update(source="local" if local else "hub", path=str(local or name), subset=script_args.dataset_train_split)
        options.update(path=spec["path"], train_split=script_args.dataset_train_split)
    else:
        spec.update(source="generated", num_samples=script_args.kk_num_samples, seed=script_args.kk_seed)
        options.update(num_samples=script_args.kk_num_samples, num_eval_samples=script_args.kk_num_eval_samples,
                       seed=script_args.kk_seed)  # fmt: skip
        if wants_eval:
            spec["num_eval_samples"] = script_args.kk_num_eval_samples
    if wants_eval and source != "generated":
        spec["eval_split"] = options["eval_split"] = script_args.dataset_test_split

    def load(with_eval: bool):
        return build_task_datasets("knights_knaves", source, with_eval=with_eval, **options)

    return DatasetPlan(spec, load, shuffle_before_truncation=False)


def _math_plan(script_args, wants_eval: bool) -> DatasetPlan:
    from ..tasks import build_task_datasets
    from ..tasks.math import MATH_DATASETS, PAPER_MATH_FILES, MathDatasetSpec, load_math_dataset

    name, eval_split = script_args.dataset_name, script_args.dataset_test_split
    spec: dict[str, Any] = {"task": "math"}
    if name in PAPER_MATH_FILES:  # the authors' parquet (raw-text prompts)
        spec.update(source="paper", name=name, data_file=script_args.math_data_file)
        if wants_eval:
            spec["eval_split"] = eval_split
        return DatasetPlan(spec, lambda with_eval: build_task_datasets(
            "math", "paper", with_eval=with_eval, train_split=name, eval_split=eval_split,
            data_file=script_args.math_data_file,
        ))  # fmt: skip
    if name in MATH_DATASETS:
        registry = MATH_DATASETS[name]
        spec.update(source="math_registry", name=name, hub_id=registry.path, split=registry.split)
        math_spec, data_files = name, None
    else:
        local = _local_data(name)
        spec.update(
            source="local" if local else "hub", path=str(local or name), split=script_args.dataset_train_split,
            problem_column=script_args.math_problem_column, answer_column=script_args.math_answer_column,
        )  # fmt: skip
        math_spec = MathDatasetSpec(
            path=spec["path"], split=spec["split"], problem_column=spec["problem_column"],
            answer_column=spec["answer_column"], name=script_args.dataset_config,
        )  # fmt: skip
        data_files = str(local) if local is not None and local.is_file() else None
    if wants_eval:
        spec["eval_split"] = eval_split

    def load_eval():
        if isinstance(math_spec, str) or eval_split in MATH_DATASETS:  # an evaluation set of the registry
            return load_math_dataset(eval_split)
        return load_math_dataset(MathDatasetSpec(**{**math_spec.__dict__, "split": eval_split}), data_files=data_files)

    def load(with_eval: bool):
        return load_math_dataset(math_spec, data_files=data_files), load_eval() if with_eval else None

    return DatasetPlan(spec, load)


def _any_dataset_plan(script_args, wants_eval: bool) -> DatasetPlan:
    local = _local_data(script_args.dataset_name)
    path, config = str(local or script_args.dataset_name), script_args.dataset_config
    train_split, eval_split = script_args.dataset_train_split, script_args.dataset_test_split
    spec = {"task": "dataset", "source": "local" if local else "hub", "path": path, "config": config,
            "split": train_split}  # fmt: skip
    if wants_eval:
        spec["eval_split"] = eval_split

    def load(with_eval: bool):
        return _load_any(path, config, train_split), _load_any(path, config, eval_split) if with_eval else None

    return DatasetPlan(spec, load)


_PLANS = {"knights_knaves": _knights_knaves_plan, "math": _math_plan, "dataset": _any_dataset_plan}


def dataset_plan(script_args, training_args=None) -> DatasetPlan:
    """
    Describes, without loading anything, the dataset a run will use; validates local paths and names.

    Args:
        script_args ([`~trl_lopti.cli.train.LoptiScriptArguments`]):
            The script arguments.
        training_args ([`LoptiGRPOConfig`], *optional*):
            Used to tell whether an evaluation set is needed.

    Returns:
        [`DatasetPlan`]: The description (`plan.spec`) and the loader (`plan.load`).
    """
    eval_strategy = str(getattr(training_args, "eval_strategy", "no"))
    wants_eval = training_args is not None and eval_strategy not in ("no", "IntervalStrategy.NO")
    plan = _PLANS[script_args.task](script_args, wants_eval)
    if script_args.max_train_samples is not None:
        plan.spec["max_train_samples"] = script_args.max_train_samples
    return plan


def dataset_spec(script_args, training_args=None) -> dict[str, Any]:
    """The description of [`dataset_plan`]: what `--dry_run` prints under `dataset`."""
    return dataset_plan(script_args, training_args).spec


def build_datasets(script_args, training_args=None):
    """
    Loads the training (and, when evaluation is on, evaluation) dataset that [`dataset_plan`] describes for the same
    arguments, and keeps `max_train_samples` training rows.

    Returns:
        `tuple[datasets.Dataset, datasets.Dataset | None]`: Train and eval datasets, both with a `prompt` column.
    """
    plan = dataset_plan(script_args, training_args)
    train, evaluation = plan.load(plan.wants_eval)
    if "prompt" not in train.column_names:
        raise CliError(f"dataset_name: the training data has no 'prompt' column (columns: {train.column_names})")
    if script_args.max_train_samples is not None:
        if plan.shuffle_before_truncation:
            train = train.shuffle(seed=script_args.kk_seed)
        train = train.select(range(min(script_args.max_train_samples, len(train))))
    return train, evaluation
