"""K&K data for TRL ([`load_knights_knaves_dataset`]): the authors' split with the exact text their model saw
(`source="paper"`; [`paper_prompt`], byte for byte the `prompt` column of their parquet files) or the Hub's
published puzzles (`source="hub"`), and generated puzzles ([`generate_dataset`])."""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._paper import AUTHORS_DATA_URL
from .puzzles import generate_puzzles, parse_statements, puzzle_record, puzzle_sizes
from .rewards import THINK_PREFILL


KNIGHTS_KNAVES_HUB_ID = "K-and-K/knights-and-knaves"
"""Hub id of the published K&K puzzles: configs `"train"` and `"test"`, splits `"2ppl"` to `"8ppl"`.

Its `train` holds 1,000 puzzles per size, which include the paper's test puzzles: never train on it as is and
evaluate on the paper's test set."""

SYSTEM_PROMPT = (
    "You are a helpful assistant. You first think through the reasoning process in your mind and then give "
    "the user the answer. The reasoning process and the answer are enclosed within <think> </think> and "
    "<answer> </answer> tags respectively, i.e., <think> reasoning process here </think><answer> answer "
    "here </answer>. The user asks you to solve a logic puzzle. After thinking, when you reach a "
    "conclusion, clearly state the identity of each character within <answer> </answer> tags, one person "
    "per line, e.g., <answer> (1) Zoey is a knight\n(2) ... </answer>."
)
"""System message of the conversational K&K prompt ([`make_prompt`]): a paraphrase of the Logic-RL
instruction. The paper's exact text is [`PAPER_SYSTEM_PROMPT`]."""

PAPER_SYSTEM_PROMPT = (
    "You are a helpful assistant. The assistant first thinks about the reasoning process in the mind and "
    "then provides the user with the answer. The reasoning process and answer are enclosed within <think> "
    "</think> and<answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think><answer> answer here </answer>.  Now the user asks you to solve a logical reasoning problem. "
    "After thinking, when you finally reach a conclusion, clearly state the identity of each character "
    "within <answer> </answer> tags. i.e., <answer> (1) Zoey is a knight\n(2) ... </answer>."
)
"""The system turn of the paper's prompt, verbatim (Logic-RL's instruction, with its missing space in
"and<answer>" and its double space before "Now")."""

PAPER_SIZES = (3, 4, 5, 6, 7)
"""Puzzle sizes of the paper's K&K training and test sets."""

PAPER_SPLITS = {"train": range(100, 1000), "test": range(1000, 1100)}
"""`index` ranges of the paper's splits, per size: train 900 puzzles, test 100."""

PAPER_KK_DIR = "data/kk/instruct"
"""Folder of the K&K files in the authors' repository: `{n}ppl/{train,test}.parquet`."""


def paper_prompt(quiz: str) -> str:
    """The exact prompt text of the paper's K&K runs for a quiz (the `quiz` column).

    Qwen2.5's chat markup written out as text: a system turn with [`PAPER_SYSTEM_PROMPT`], a user turn with
    the quiz, each ending in a newline before `<|im_end|>`, then an open assistant turn pre-filled with
    `<think>`. It equals the `prompt` column of all 5,500 rows of the authors'
    `data/kk/instruct/{3..7}ppl/{train,test,test_new}.parquet` byte for byte. Give it to TRL as a plain-text
    prompt: no chat template goes on top."""
    return (
        f"<|im_start|>system\n{PAPER_SYSTEM_PROMPT}\n<|im_end|>\n"
        f"<|im_start|>user\n{quiz}\n<|im_end|>\n"
        f"<|im_start|>assistant\n{THINK_PREFILL}"
    )


def make_prompt(quiz: str, system_prompt: str = SYSTEM_PROMPT, prefill_think: bool = False) -> list[dict[str, str]]:
    """The conversational prompt of a puzzle: the system message and the quiz.

    With `prefill_think`, an assistant message holding `"<think>"` follows for the model to continue, as the
    paper prompts. Give such prompts to TRL as text ([`render_prompts_as_text`], as the CLI does): the
    `<think>` is then part of the prompt, not of the completion, and scored with `think_prefilled=True` (the
    `think_prefilled` column does this automatically)."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": quiz}]
    if prefill_think:
        messages.append({"role": "assistant", "content": THINK_PREFILL})
    return messages


def generate_dataset(
    num_people: int | Sequence[int],
    num_samples: int,
    system_prompt: str = SYSTEM_PROMPT,
    prefill_think: bool = False,
    **generator_options: Any,
):
    """`num_samples` Knights & Knaves puzzles with exactly one solution ([`generate_puzzles`], which takes
    `**generator_options`: `seed`, `max_width`, `max_attempts`) as a TRL-ready dataset: columns `prompt` (see
    [`make_prompt`]), the puzzle columns and `think_prefilled` (`prefill_think`, which the K&K reward
    functions read to count the pre-filled `<think>` as part of the response)."""
    from datasets import Dataset

    puzzles = generate_puzzles(num_people, num_samples, **generator_options)
    return Dataset.from_list([knights_knaves_record_to_example(row, system_prompt, prefill_think) for row in puzzles])


def knights_knaves_record_to_example(
    record: dict[str, Any], system_prompt: str = SYSTEM_PROMPT, prefill_think: bool = False
) -> dict[str, Any]:
    """One row of the published K&K data, or of [`generate_puzzles`], as a row of [`generate_dataset`].

    The row has the columns `quiz`, `names`, `solution`, `solution_text`, `solution_text_format`,
    `statements`, ...; the example has its conversational `prompt` ([`make_prompt`]), the puzzle columns of
    [`puzzle_record`] and `think_prefilled`."""
    quiz = record["quiz"]
    names = [str(name) for name in record["names"]]
    statements = str(parse_statements(record["statements"]))
    puzzle = puzzle_record(
        quiz,
        names,
        record["solution"],
        statements,
        solution_text_format=record.get("solution_text_format"),
        solution_text=record.get("solution_text"),
    )
    return {"prompt": make_prompt(quiz, system_prompt, prefill_think), **puzzle, "think_prefilled": prefill_think}


def prepare_knights_knaves_dataset(dataset, system_prompt: str = SYSTEM_PROMPT, prefill_think: bool = False):
    """A dataset in the published K&K format (from the Hub or local JSON/parquet files) mapped to the columns
    of [`generate_dataset`]; its other columns are dropped."""
    fn_kwargs = {"system_prompt": system_prompt, "prefill_think": prefill_think}
    return dataset.map(knights_knaves_record_to_example, fn_kwargs=fn_kwargs, remove_columns=dataset.column_names)


def paper_record_to_example(record: dict[str, Any]) -> dict[str, Any]:
    """One row of the authors' `data/kk/instruct/{n}ppl/{train,test}.parquet` with the paper's text prompt.

    The example has the columns of [`generate_dataset`] plus `index`; the row's `prompt` is checked to be
    [`paper_prompt`] of its quiz."""
    prompt = paper_prompt(record["quiz"])
    published = record.get("prompt")
    if published is not None:
        messages = list(published)
        text = messages[0].get("content") if len(messages) == 1 and isinstance(messages[0], dict) else None
        if text != prompt:
            index = record.get("index")
            raise ValueError(f"prompt: row index {index} does not hold the paper's prompt text for its quiz")
    # The conversational `prompt` (the first key) is replaced by the text.
    example = knights_knaves_record_to_example(record, prefill_think=True)
    return {**example, "prompt": prompt, "index": int(record["index"])}


def _load_paper_split(split: str, sizes: Sequence[int], data_dir: str | None):
    import datasets

    files = [f"{AUTHORS_DATA_URL}/{PAPER_KK_DIR}/{size}ppl/{split}.parquet" for size in sizes]
    if data_dir is not None:
        files = [str(Path(data_dir).expanduser() / f"{size}ppl" / f"{split}.parquet") for size in sizes]
        if missing := [file for file in files if not Path(file).is_file()]:
            layout = "{3..7}ppl/{train,test}.parquet"
            raise FileNotFoundError(f"data_dir: missing {missing} (expected the layout {layout})")
    rows = datasets.load_dataset("parquet", data_files=files, split="train")
    indices = PAPER_SPLITS[split]
    rows = rows.filter(lambda index: index in indices, input_columns="index")
    return rows.map(paper_record_to_example, remove_columns=rows.column_names)


def load_paper_knights_knaves(
    split: str = "train", num_people: Sequence[int] = PAPER_SIZES, data_dir: str | None = None
):
    """The paper's K&K `split` of the sizes `num_people`, in this order.

    `"train"` has 900 puzzles per size (4,500 for sizes 3-7), `"test"` 100 per size (the authors'
    `test.parquet`, which holds the same puzzles as their `test_new.parquet`). They come from the authors'
    repository ([`AUTHORS_DATA_URL`]) or a local `data_dir` laid out as `{n}ppl/{split}.parquet`, with the
    columns of [`generate_dataset`] (`prompt`: the text of [`paper_prompt`]) and `index`.

    Rows are kept by `index` ([`PAPER_SPLITS`]: train 100-999, test 1000-1099 per size), so a file that holds
    more (the Hub's 1,000-per-size `train`) still gives the paper's split. The train and test quizzes are
    checked to be disjoint (both splits are read)."""
    if split not in PAPER_SPLITS:
        raise ValueError(f"split: must be one of {list(PAPER_SPLITS)}, got {split!r}")
    sizes = puzzle_sizes(num_people)
    loaded = {name: _load_paper_split(name, sizes, data_dir) for name in PAPER_SPLITS}
    if shared := set(loaded["train"]["quiz"]) & set(loaded["test"]["quiz"]):
        raise ValueError(f"The paper's train and test splits share {len(shared)} puzzles; check the files in use")
    return loaded[split]


KNIGHTS_KNAVES_SOURCES = ("paper", "hub")
"""Values of `source` of [`load_knights_knaves_dataset`]."""


def load_knights_knaves_dataset(
    num_people: int | Sequence[int] = PAPER_SIZES,
    split: str = "train",
    source: str = "paper",
    data_dir: str | None = None,
    path: str = KNIGHTS_KNAVES_HUB_ID,
    system_prompt: str = SYSTEM_PROMPT,
    prefill_think: bool = False,
    **load_dataset_kwargs: Any,
):
    """
    Loads published K&K puzzles: the paper's split and prompt, or the Hub set.

    Args:
        num_people (`int` or `Sequence[int]`, *optional*, defaults to `(3, 4, 5, 6, 7)`):
            Puzzle sizes, 2 to 8 (the paper's files: 3 to 7); several are concatenated in the given order.
        split (`str`, *optional*, defaults to `"train"`):
            `"train"` or `"test"`: the paper's split ([`load_paper_knights_knaves`]) or the Hub set's config
            ([`KNIGHTS_KNAVES_HUB_ID`]: its `"train"` holds the paper's test puzzles).
        source (`str`, *optional*, defaults to `"paper"`):
            `"paper"`: the authors' parquet files (by URL, or from `data_dir`), text prompts
            ([`paper_prompt`]), the paper's index split. `"hub"`: the Hub set (or a local copy at `path`),
            conversational prompts.
        data_dir (`str`, *optional*):
            Paper source: a local folder laid out as `{n}ppl/{split}.parquet`.
        path (`str`, *optional*, defaults to `"K-and-K/knights-and-knaves"`):
            Hub source: the Hub id, or a local copy with the same layout.
        system_prompt (`str`, *optional*, defaults to [`SYSTEM_PROMPT`]):
            Hub source: the system message of each prompt.
        prefill_think (`bool`, *optional*, defaults to `False`):
            Hub source: whether to pre-fill `<think>` ([`generate_dataset`]); the paper's prompts always do.
        **load_dataset_kwargs:
            Hub source: passed to `datasets.load_dataset` (e.g. `revision`, `cache_dir`).
    """
    if source not in KNIGHTS_KNAVES_SOURCES:
        raise ValueError(f"source: must be one of {list(KNIGHTS_KNAVES_SOURCES)}, got {source!r}")
    sizes = puzzle_sizes(num_people)
    if source == "paper":
        return load_paper_knights_knaves(split, sizes, data_dir)
    import datasets

    raws = [datasets.load_dataset(path, split, split=f"{size}ppl", **load_dataset_kwargs) for size in sizes]
    parts = [prepare_knights_knaves_dataset(raw, system_prompt, prefill_think) for raw in raws]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def render_prompts_as_text(dataset, tokenizer, prompt_column: str = "prompt"):
    """`dataset` with its conversational prompts rendered to text by the model's chat template (`tokenizer`).

    A final assistant message is continued. TRL 1.16's `GRPOTrainer` applies the chat template with
    `add_generation_prompt=True` and never continues one, so a prompt that pre-fills `"<think>"` (the paper's
    format, `prefill_think=True`) must be given to it as text, which leaves the assistant turn open for the
    model to continue. Prompts without a final assistant message get the usual generation prompt."""

    def render(example: dict[str, Any]) -> dict[str, str]:
        messages = example[prompt_column]
        if isinstance(messages, str):
            return {prompt_column: messages}
        continues = messages[-1]["role"] == "assistant"
        flags = {"add_generation_prompt": not continues, "continue_final_message": continues}
        return {prompt_column: tokenizer.apply_chat_template(messages, tokenize=False, **flags)}

    return dataset.map(render)
