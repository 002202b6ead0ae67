"""One entry point that builds a task's training and evaluation datasets from plain options (used by the CLI)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


TASK_SOURCES = {"knights_knaves": ("paper", "hub", "generated"), "math": ("paper",)}
"""The sources [`build_task_datasets`] knows, per task."""


def build_task_datasets(
    task: str,
    source: str,
    with_eval: bool = False,
    num_people: Sequence[int] = (3, 4, 5, 6, 7),
    data_dir: str | None = None,
    path: str | None = None,
    train_split: str = "train",
    eval_split: str = "test",
    num_samples: int = 1000,
    num_eval_samples: int = 100,
    seed: int = 0,
    prefill_think: bool = True,
    data_file: str | None = None,
) -> tuple[Any, Any]:
    """
    Builds the training (and optionally evaluation) dataset of a task.

    Args:
        task (`str`):
            `"knights_knaves"` or `"math"`.
        source (`str`):
            K&K: `"paper"` (the authors' split and prompt text; `eval_split` names the evaluation split, `"test"`),
            `"hub"` (`K-and-K/knights-and-knaves` or a local copy at `path`; `train_split`/`eval_split` are its
            configs) or `"generated"` (`num_samples` + `num_eval_samples` distinct puzzles from `seed`). Math:
            `"paper"` (the authors' parquet file named by `train_split`, e.g. `"dsr_uniform"`; `eval_split` another
            of `trl_lopti.tasks.math.PAPER_MATH_FILES`).
        with_eval (`bool`, *optional*, defaults to `False`):
            Also build the evaluation dataset.
        num_people (`Sequence[int]`, *optional*, defaults to `(3, 4, 5, 6, 7)`):
            K&K puzzle sizes.
        data_dir (`str`, *optional*):
            K&K paper source: local folder laid out as `{n}ppl/{split}.parquet` (default: the authors' files by URL).
        path (`str`, *optional*):
            K&K hub source: Hub id or local copy (default `K-and-K/knights-and-knaves`).
        train_split (`str`, *optional*, defaults to `"train"`):
            See `source`.
        eval_split (`str`, *optional*, defaults to `"test"`):
            See `source`.
        num_samples (`int`, *optional*, defaults to `1000`):
            K&K generated source: training puzzles.
        num_eval_samples (`int`, *optional*, defaults to `100`):
            K&K generated source: evaluation puzzles.
        seed (`int`, *optional*, defaults to `0`):
            K&K generated source: generator seed.
        prefill_think (`bool`, *optional*, defaults to `True`):
            K&K hub and generated sources: end prompts with an assistant `"<think>"` (the paper source always does).
        data_file (`str`, *optional*):
            Math paper source: local copy of the training file (default: the authors' file by URL).

    Returns:
        `tuple[datasets.Dataset, datasets.Dataset | None]`: Train and eval datasets, both with a `prompt` column.
    """
    if task not in TASK_SOURCES:
        raise ValueError(f"task: must be one of {list(TASK_SOURCES)}, got {task!r}")
    if source not in TASK_SOURCES[task]:
        raise ValueError(f"source: task {task!r} takes one of {list(TASK_SOURCES[task])}, got {source!r}")
    if task == "math":
        from .math import load_paper_math_dataset

        train = load_paper_math_dataset(train_split, data_file)
        return train, load_paper_math_dataset(eval_split) if with_eval else None

    from .knights_knaves import KNIGHTS_KNAVES_HUB_ID, generate_dataset, load_knights_knaves_dataset

    if source == "generated":
        total = num_samples + (num_eval_samples if with_eval else 0)
        puzzles = generate_dataset(list(num_people), total, seed=seed, prefill_think=prefill_think)
        train = puzzles.select(range(num_samples))
        return train, puzzles.select(range(num_samples, total)) if with_eval else None
    options = {"num_people": list(num_people), "source": source}
    if source == "paper":
        options["data_dir"] = data_dir
    else:
        options.update(path=path or KNIGHTS_KNAVES_HUB_ID, prefill_think=prefill_think)
    train = load_knights_knaves_dataset(split=train_split, **options)
    return train, load_knights_knaves_dataset(split=eval_split, **options) if with_eval else None
