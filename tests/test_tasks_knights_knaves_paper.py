"""K&K as the authors ran it: the exact prompt text, the paper split loader (on parquet files written here in the
authors' layout and columns), the published phrasing of the generator, and the CLI's `kk_source: paper`."""

from __future__ import annotations

import random
import re

import pytest

from trl_lopti.tasks import knights_knaves as kk


# The authors' prompt, typed out from their data/kk/instruct/*/train.parquet `prompt` column (one user message whose
# content is the whole text): Logic-RL's instruction with its quirks ("and<answer>", two spaces before "Now").
AUTHORS_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant. The assistant first thinks about the reasoning process in the "
    "mind and then provides the user with the answer. The reasoning process and answer are enclosed within <think> "
    "</think> and<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer "
    "here </answer>.  Now the user asks you to solve a logical reasoning problem. After thinking, when you finally "
    "reach a conclusion, clearly state the identity of each character within <answer> </answer> tags. i.e., <answer> "
    "(1) Zoey is a knight\n(2) ... </answer>.\n<|im_end|>\n<|im_start|>user\n{quiz}\n<|im_end|>\n"
    "<|im_start|>assistant\n<think>"
)
PUBLISHED_QUIZ = (
    "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and knaves always "
    'lie. You meet 3 inhabitants: Michael, Zoey, and Ethan. Michael was heard saying, "Ethan is a knight if and only if '
    'Michael is a knight". "Zoey is a knight or Ethan is a knight," Zoey mentioned. Ethan asserted: "Michael is a knave '
    'if and only if Zoey is a knave". So who is a knight and who is a knave?'
)
PUBLISHED_STATEMENTS = (
    "(('<=>', ('telling-truth', 2), ('telling-truth', 0)), ('or', ('telling-truth', 1), ('telling-truth', 2)), "
    "('<=>', ('lying', 0), ('lying', 1)))"
)


def test_paper_prompt_is_the_published_text_byte_for_byte():
    assert kk.paper_prompt(PUBLISHED_QUIZ) == AUTHORS_PROMPT.format(quiz=PUBLISHED_QUIZ)
    assert kk.paper_prompt("Q").encode() == AUTHORS_PROMPT.format(quiz="Q").encode()


# ---------------------------------------------------------------------------------------------------------------------
# The paper split, from parquet files in the authors' layout
# ---------------------------------------------------------------------------------------------------------------------
def authors_row(puzzle: dict, index: int, prompt_text: str | None = None) -> dict:
    """A row with the columns of the authors' parquet files (the extra verl columns included)."""
    return {
        "quiz": puzzle["quiz"],
        "names": puzzle["names"],
        "solution": puzzle["solution"],
        "solution_text": puzzle["solution_text"],
        "solution_text_format": puzzle["solution_text_format"],
        "statements": puzzle["statements"],
        "index": index,
        "data_source": "kk_logic",
        "prompt": [{"content": prompt_text or AUTHORS_PROMPT.format(quiz=puzzle["quiz"]), "role": "user"}],
        "ability": "logic",
        "reward_model": {
            "ground_truth": {
                "solution_text_format": puzzle["solution_text_format"],
                "statements": puzzle["statements"],
            },
            "style": "rule",
        },
        "extra_info": {"index": index, "split": "train" if index < 1000 else "test"},
    }


TRAIN_INDICES = list(range(96, 104))  # 96-99 lie outside the paper's train range (as in a 1,000-per-size file)
TEST_INDICES = [1000, 1001, 1002]


def write_authors_layout(root, sizes=(3, 4), train_indices=TRAIN_INDICES, test_indices=TEST_INDICES, edit=None):
    import datasets

    for size in sizes:
        puzzles = kk.generate_puzzles(size, len(train_indices) + len(test_indices), seed=size)
        rows = [authors_row(p, i) for p, i in zip(puzzles, train_indices + test_indices, strict=True)]
        if edit is not None:
            edit(size, rows)
        folder = root / f"{size}ppl"
        folder.mkdir(parents=True)
        datasets.Dataset.from_list(rows[: len(train_indices)]).to_parquet(str(folder / "train.parquet"))
        datasets.Dataset.from_list(rows[len(train_indices) :]).to_parquet(str(folder / "test.parquet"))
    return root


def test_paper_split_keeps_the_index_ranges_and_the_exact_prompts(tmp_path):
    data_dir = write_authors_layout(tmp_path / "kk")
    train = kk.load_knights_knaves_dataset([3, 4], split="train", data_dir=str(data_dir))
    test = kk.load_knights_knaves_dataset([3, 4], split="test", source="paper", data_dir=str(data_dir))
    assert train["index"] == [100, 101, 102, 103] * 2 and train["num_people"] == [3] * 4 + [4] * 4
    assert test["index"] == TEST_INDICES * 2
    assert not set(train["quiz"]) & set(test["quiz"])
    for row in train.to_list() + test.to_list():
        assert row["prompt"] == AUTHORS_PROMPT.format(quiz=row["quiz"])  # text, no chat template on top
        assert row["think_prefilled"] is True
        # The reward counts the pre-filled <think>: a right answer in the paper's format scores 3.
        answer = f"reasoning</think><answer>{row['solution_text_format']}</answer>"
        assert kk.knights_knaves_reward([answer], [row["solution_text_format"]], [row["think_prefilled"]]) == [3.0]


def test_paper_split_rejects_overlapping_splits_and_foreign_prompts(tmp_path):
    def leak(size, rows):  # a test puzzle also in the train range
        rows[len(TRAIN_INDICES)] = {**rows[5], "index": 1000}

    data_dir = write_authors_layout(tmp_path / "leak", edit=leak)
    with pytest.raises(ValueError, match="share 2 puzzles"):
        kk.load_knights_knaves_dataset([3, 4], split="test", data_dir=str(data_dir))

    def chat_template_prompt(size, rows):
        rows[6]["prompt"] = [{"content": "<|im_start|>user\n" + rows[6]["quiz"], "role": "user"}]

    data_dir = write_authors_layout(tmp_path / "foreign", edit=chat_template_prompt)
    with pytest.raises(ValueError, match="row index 102 does not hold the paper's prompt"):
        kk.load_knights_knaves_dataset([3], split="train", data_dir=str(data_dir))
    with pytest.raises(FileNotFoundError, match="5ppl"):
        kk.load_knights_knaves_dataset([3, 5], data_dir=str(data_dir))
    with pytest.raises(ValueError, match="split: must be one of"):
        kk.load_knights_knaves_dataset([3], split="validation", data_dir=str(data_dir))
    with pytest.raises(ValueError, match="source: must be one of"):
        kk.load_knights_knaves_dataset([3], source="github")


def test_paper_files_are_read_from_the_authors_repository_by_default(monkeypatch):
    import datasets

    read = []

    def fake_load_dataset(builder, data_files, split):
        read.append(data_files)
        raise RuntimeError("stop here")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(RuntimeError, match="stop here"):
        kk.load_knights_knaves_dataset(split="test")
    base = "https://raw.githubusercontent.com/zhyang2226/AR-Lopti/cbeb333376decdfe571fa8613bdebcfcc526628d"
    assert read == [[f"{base}/data/kk/instruct/{size}ppl/train.parquet" for size in (3, 4, 5, 6, 7)]]


def cli_datasets(tmp_path, *flags):
    from trl_lopti.cli.train import build_datasets, parse_train_args

    args = [
        "--model_name_or_path",
        "Qwen/Qwen2.5-3B-Instruct",
        "--use_cpu",
        "true",
        "--output_dir",
        str(tmp_path),
        "--eval_strategy",
        "steps",
        "--kk_num_samples",
        "4",
        "--kk_num_eval_samples",
        "2",
        *flags,
    ]
    return build_datasets(*parse_train_args(args)[:2])


def test_the_cli_trains_on_the_paper_split_and_evaluates_on_the_paper_test_set(tmp_path):
    data_dir = str(write_authors_layout(tmp_path / "kk"))
    train, evaluation = cli_datasets(
        tmp_path,
        "--kk_source",
        "paper",
        "--kk_data_dir",
        data_dir,
        "--kk_num_people",
        "3",
        "4",
        "--kk_prefill_think",
        "false",
    )
    assert train.to_list() == kk.load_knights_knaves_dataset([3, 4], split="train", data_dir=data_dir).to_list()
    assert evaluation.to_list() == kk.load_knights_knaves_dataset([3, 4], split="test", data_dir=data_dir).to_list()
    assert all(prompt.endswith("<think>") for prompt in train["prompt"])  # the paper's prompts always pre-fill it


def test_the_cli_kk_source_overrides_the_dataset_name_rule(tmp_path, monkeypatch):
    import datasets

    generated, _ = cli_datasets(tmp_path)  # no dataset_name: generated puzzles
    assert len(generated) == 4 and "index" not in generated.column_names
    generated, _ = cli_datasets(tmp_path, "--dataset_name", "K-and-K/knights-and-knaves", "--kk_source", "generated")
    assert len(generated) == 4
    rows = [authors_row(puzzle, 1000 + i) for i, puzzle in enumerate(kk.generate_puzzles(3, 2, seed=0))]
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hub, hub_eval = cli_datasets(tmp_path, "--dataset_name", "K-and-K/knights-and-knaves")  # dataset_name: the hub
    assert calls == [("K-and-K/knights-and-knaves", "train", "3ppl"), ("K-and-K/knights-and-knaves", "test", "3ppl")]
    assert hub["quiz"] == [row["quiz"] for row in rows] and len(hub_eval) == 2


def test_text_prompts_pass_through_the_cli_rendering_unchanged(tiny_model_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    dataset = Dataset.from_list([{"prompt": kk.paper_prompt(PUBLISHED_QUIZ)}])
    assert kk.render_prompts_as_text(dataset, tokenizer)["prompt"] == [AUTHORS_PROMPT.format(quiz=PUBLISHED_QUIZ)]


# ---------------------------------------------------------------------------------------------------------------------
# The generator's phrasing is the published one
# ---------------------------------------------------------------------------------------------------------------------
class ScriptedChoice(random.Random):
    """An rng whose `choice` returns given items in turn (to replay a published quiz's templates)."""

    def __init__(self, items):
        super().__init__(0)
        self.items = list(items)

    def choice(self, sequence):
        item = self.items.pop(0)
        assert item in sequence
        return item


def test_published_quizzes_are_rendered_exactly_from_the_speech_templates():
    statements = kk.parse_statements(PUBLISHED_STATEMENTS)
    names = ["Michael", "Zoey", "Ethan"]
    chosen = []
    for speaker, statement in enumerate(statements):
        claim = kk.render_statement(statement, names)
        sentences = [template.format(name=names[speaker], claim=claim) for template in kk.SPEECH_TEMPLATES]
        matching = [
            t for t, sentence in zip(kk.SPEECH_TEMPLATES, sentences, strict=True) if sentence in PUBLISHED_QUIZ
        ]
        assert len(matching) == 1, (speaker, matching)
        chosen += matching
    assert kk.render_quiz(statements, names, ScriptedChoice(chosen)) == PUBLISHED_QUIZ


def test_generator_uses_the_published_pool_and_templates():
    assert len(kk.NAMES) == len(set(kk.NAMES)) == 51
    assert len(kk.SPEECH_TEMPLATES) == len(set(kk.SPEECH_TEMPLATES)) == 18
    rows = kk.generate_puzzles([3, 7], 60, seed=11)
    used_names = {name for row in rows for name in row["names"]}
    assert used_names <= set(kk.NAMES) and len(used_names) > 40
    # The published quirks: only `said, "..."` puts the period inside the quotes; "If" keeps its capital after "that".
    quizzes = " ".join(row["quiz"] for row in rows)
    assert 'said, "' in quizzes and not re.search(r'(stated|remarked|noted|commented), "[^"]*\."', quizzes)
    assert "that if " not in quizzes
