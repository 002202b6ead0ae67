"""Math data of arXiv 2505.12929 for TRL.

[`load_paper_math_dataset`] loads the authors' DSR-uniform training set (10,000 DeepScaleR problems spread
evenly over difficulty) and evaluation sets, with the raw-text prompts their model saw. [`load_math_dataset`]
loads Hub sets ([`MATH_DATASETS`]) or local files with the same columns."""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._paper import AUTHORS_DATA_URL
from .grading import normalize_reference


PAPER_MATH_FILES: dict[str, str] = {
    "dsr_uniform": "data/deepscaler_c/deepscaler_uniform_train.parquet",
    "aime_dsr": "data/deepscaler/aime_dsr.parquet",
    "amc_dsr": "data/deepscaler/amc_dsr.parquet",
    "math_dsr": "data/deepscaler/math_dsr.parquet",
    "olympiad_bench_dsr": "data/deepscaler/olympiad_bench_dsr.parquet",
}
"""The authors' math parquet files by short name, relative to [`AUTHORS_DATA_URL`].

`"dsr_uniform"` is the paper's training set (10,000 problems); the others are their evaluation sets (AIME
2024: 30, AMC: 83, MATH-500: 500, OlympiadBench: 675). Their Minerva file is left out: 75 of its answers are
lists of alternatives, which [`math_reward`] does not grade."""

MATH_PROMPT_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
"""Appended to every problem, as in the paper's (DeepScaleR's) math prompts."""


@dataclass(frozen=True)
class MathDatasetSpec:
    """Where a math set lives on the Hugging Face Hub (id, split, config `name`) and which columns hold the
    problem and the final answer (a string, a number, or a list of strings that together form the answer)."""

    path: str
    split: str
    problem_column: str
    answer_column: str
    name: str | None = None
    year_column: str | None = None  # with `years`: keep the rows of these years (inclusive)
    years: tuple[int, int] | None = None
    data_file: str | None = None  # a set stored as one JSON file of `[question, answer]` message pairs (ORZ)


MATH_DATASETS: dict[str, MathDatasetSpec] = {
    # Training sets
    "deepscaler": MathDatasetSpec("agentica-org/DeepScaleR-Preview-Dataset", "train", "problem", "answer"),
    "orz": MathDatasetSpec(
        "Open-Reasoner-Zero/orz_math_57k_collection",
        "train",
        "value",
        "ground_truth",
        data_file="orz_math_57k_collection.json",
    ),
    # Evaluation sets
    "math500": MathDatasetSpec("HuggingFaceH4/MATH-500", "test", "problem", "answer"),
    "aime": MathDatasetSpec(
        "di-zhang-fdu/AIME_1983_2024", "train", "Question", "Answer", year_column="Year", years=(2021, 2024)
    ),
    "aime24": MathDatasetSpec("HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    "amc": MathDatasetSpec("AI-MO/aimo-validation-amc", "train", "problem", "answer"),
    "minerva": MathDatasetSpec("math-ai/minervamath", "test", "question", "answer"),
    "olympiadbench": MathDatasetSpec("math-ai/olympiadbench", "test", "question", "final_answer"),
}
"""The paper's math sets by short name.

`"aime"` is AIME 2021-2024 (the paper's AIME set), `"aime24"` AIME 2024 only; `"amc"` is AMC 2022-2023
(83 problems), `"minerva"` Minerva-Math (272), `"olympiadbench"` the 675 open-ended English text-only math
problems of OlympiadBench. Pass a [`MathDatasetSpec`] to [`load_math_dataset`] for another mirror."""


def make_math_prompt(
    problem: str, prompt_suffix: str = MATH_PROMPT_SUFFIX, system_prompt: str | None = None, text_prompt: bool = False
) -> list[dict[str, str]] | str:
    """The conversational prompt of a problem in the paper's style.

    The user message is the problem, a space and `prompt_suffix` (the instruction to reason step by step and
    box the final answer), after an optional system message (the paper uses none). With `text_prompt`, the
    prompt is that text itself, as the authors fed it to the model without a chat template."""
    content = f"{problem.strip()} {prompt_suffix}".strip()
    if text_prompt:
        if system_prompt:
            raise ValueError("system_prompt: a raw-text prompt (text_prompt=True) has no system message")
        return content
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": content}]


def math_record_to_example(
    record: dict[str, Any],
    problem_column: str,
    answer_column: str,
    prompt_suffix: str = MATH_PROMPT_SUFFIX,
    system_prompt: str | None = None,
    text_prompt: bool = False,
) -> dict[str, Any]:
    """One row of a math set as the TRL columns `prompt` ([`make_math_prompt`]) and `solution` (the reference
    answer), and the raw `problem`."""
    problem = str(record[problem_column])
    prompt = make_math_prompt(problem, prompt_suffix, system_prompt, text_prompt)
    return {"prompt": prompt, "problem": problem, "solution": normalize_reference(record[answer_column])}


def orz_pairs_to_records(pairs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The JSON content of the ORZ file as rows with columns `value` (the question) and `ground_truth`.

    The file holds pairs of messages `{"from": "human", "value": question}` and
    `{"from": "assistant", "ground_truth": {"value": answer}}`; `ground_truth` is the answer as a string."""
    return [
        {"value": question.get("value", ""), "ground_truth": normalize_reference(answer.get("ground_truth", ""))}
        for question, answer in (pair[:2] for pair in pairs)
    ]


def load_math_dataset(
    name: str | MathDatasetSpec,
    data_files: str | Sequence[str] | None = None,
    prompt_suffix: str = MATH_PROMPT_SUFFIX,
    system_prompt: str | None = None,
    text_prompt: bool = False,
    **load_dataset_kwargs: Any,
):
    """
    Loads one of the paper's math sets with the columns `prompt`, `problem` and `solution`.

    `prompt` is conversational, in the paper's prompt style; `solution` is the reference answer as a string,
    for [`math_reward`]. Other columns are dropped, DeepScaleR's worked `solution` included: here `solution`
    is the final answer.

    Args:
        name (`str` or [`MathDatasetSpec`]):
            A key of [`MATH_DATASETS`] (`"deepscaler"`, `"orz"`, `"math500"`, `"aime"`, ...), or a spec.
        data_files (`str` or `Sequence[str]`, *optional*):
            Local `.json`/`.jsonl`/`.parquet`/`.csv` files with the same columns as the Hub set, read instead
            of the Hub (for ORZ: its JSON file of message pairs).
        prompt_suffix (`str`, *optional*, defaults to [`MATH_PROMPT_SUFFIX`]):
            The instruction appended to each problem.
        system_prompt (`str`, *optional*):
            A system message before each problem.
        text_prompt (`bool`, *optional*, defaults to `False`):
            Whether `prompt` is the raw text (problem + instruction), without a chat template, as the
            authors prompt.
        **load_dataset_kwargs:
            Passed to `datasets.load_dataset` (e.g. `revision`, `cache_dir`).
    """
    if not isinstance(name, MathDatasetSpec) and name not in MATH_DATASETS:
        raise ValueError(f"Unknown math dataset {name!r}; choose one of {sorted(MATH_DATASETS)} or pass a spec")
    spec = name if isinstance(name, MathDatasetSpec) else MATH_DATASETS[name]
    import datasets

    if spec.data_file is not None:
        # A single JSON file of message pairs (ORZ).
        paths = [data_files] if isinstance(data_files, str) else list(data_files or [])
        if not paths:
            from huggingface_hub import hf_hub_download

            paths = [hf_hub_download(spec.path, spec.data_file, repo_type="dataset")]
        pairs = [pair for path in paths for pair in json.loads(Path(path).read_text(encoding="utf-8"))]
        raw = datasets.Dataset.from_list(orz_pairs_to_records(pairs))
    elif data_files is not None:
        # Local files with the Hub set's columns.
        first = data_files if isinstance(data_files, str) else next(iter(data_files))
        extension = first.rsplit(".", 1)[-1]
        builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}[extension]
        raw = datasets.load_dataset(builder, data_files=data_files, split="train", **load_dataset_kwargs)
    else:
        raw = datasets.load_dataset(spec.path, spec.name, split=spec.split, **load_dataset_kwargs)
    if spec.year_column is not None and spec.years is not None:
        first_year, last_year = spec.years
        raw = raw.filter(lambda year: first_year <= int(year) <= last_year, input_columns=spec.year_column)
    fn_kwargs = {
        "problem_column": spec.problem_column,
        "answer_column": spec.answer_column,
        "prompt_suffix": prompt_suffix,
        "system_prompt": system_prompt,
        "text_prompt": text_prompt,
    }
    mapped = raw.map(math_record_to_example, fn_kwargs=fn_kwargs, remove_columns=raw.column_names)
    return mapped.select_columns(["prompt", "problem", "solution"])


def paper_math_record_to_example(record: dict[str, Any]) -> dict[str, Any]:
    """One row of the authors' verl parquet files with the columns `prompt`, `solution` and `difficulty`.

    The row's `prompt` is one message whose content is the full prompt text (kept as is), its
    `reward_model.ground_truth` the answer; `difficulty` is `None` where absent."""
    messages = list(record["prompt"])
    if len(messages) != 1 or "content" not in messages[0]:
        raise ValueError(f"prompt: expected one message holding the prompt text, got {messages!r:.200}")
    answer = record["reward_model"]["ground_truth"]
    if isinstance(answer, (list, tuple)) or hasattr(answer, "tolist"):
        alternatives = list(answer)
        if len(alternatives) != 1:
            raise ValueError(f"reward_model.ground_truth: {len(alternatives)} alternative answers are not supported")
        answer = alternatives[0]
    difficulty = (record.get("extra_info") or {}).get("difficulty")
    difficulty = None if difficulty is None else float(difficulty)
    return {"prompt": messages[0]["content"], "solution": normalize_reference(answer), "difficulty": difficulty}


def load_paper_math_dataset(name: str = "dsr_uniform", data_file: str | None = None):
    """
    Loads one of the authors' math parquet files, with the prompt text exactly as their model saw it.

    The prompt is raw text (the problem, a space, [`MATH_PROMPT_SUFFIX`]) fed without a chat template, which
    TRL's `GRPOTrainer` tokenizes as is. The columns are `prompt` (that text), `solution` and `difficulty`
    (the authors' difficulty score, `None` where absent). Grade with [`math_reward`] (the paper's grading).

    Args:
        name (`str`, *optional*, defaults to `"dsr_uniform"`):
            A key of [`PAPER_MATH_FILES`]; `"dsr_uniform"` is the training set.
        data_file (`str`, *optional*):
            A local copy, or another URL, to read instead.
    """
    if name not in PAPER_MATH_FILES:
        raise ValueError(f"name: unknown paper math set {name!r}; choose one of {sorted(PAPER_MATH_FILES)}")
    import datasets

    source = data_file or f"{AUTHORS_DATA_URL}/{PAPER_MATH_FILES[name]}"
    raw = datasets.load_dataset("parquet", data_files=source, split="train")
    return raw.map(paper_math_record_to_example, remove_columns=raw.column_names)
