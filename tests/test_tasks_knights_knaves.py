"""Knights & Knaves: puzzle generator, published-data loader and the paper's reward (checked against the spec and an
independent brute-force solver written here)."""

from __future__ import annotations

import ast
import itertools
import json
import random
import re

import pytest

from trl_lopti.tasks import knights_knaves as kk


# ---------------------------------------------------------------------------------------------------------------------
# Independent reference: brute force over all assignments, recursive evaluation, own renderer
# ---------------------------------------------------------------------------------------------------------------------
def holds(statement, knights):
    operator, operands = statement[0], statement[1:]
    if operator == "telling-truth":
        return knights[operands[0]]
    if operator == "lying":
        return not knights[operands[0]]
    if operator == "not":
        return not holds(operands[0], knights)
    if operator == "and":
        return all(holds(operand, knights) for operand in operands)
    if operator == "or":
        return any(holds(operand, knights) for operand in operands)
    if operator == "->":
        return (not holds(operands[0], knights)) or holds(operands[1], knights)
    if operator == "<=>":
        return holds(operands[0], knights) == holds(operands[1], knights)
    raise AssertionError(f"unexpected operator {operator!r}")


def brute_force_solutions(statements):
    return [
        knights
        for knights in itertools.product([True, False], repeat=len(statements))
        if all(holds(statement, knights) == knights[person] for person, statement in enumerate(statements))
    ]


def spell_atom(atom, names, negated=False):
    role = {"telling-truth": "a knight", "lying": "a knave"}[atom[0]]
    return f"{names[atom[1]]} is {'not ' if negated else ''}{role}"


def spell(statement, names):
    operator = statement[0]
    if operator == "not":
        return spell_atom(statement[1], names, negated=True)
    if operator == "and":
        return " and ".join(spell_atom(operand, names) for operand in statement[1:])
    if operator == "or":
        return " or ".join(spell_atom(operand, names) for operand in statement[1:])
    if operator == "->":
        return f"if {spell_atom(statement[1], names)} then {spell_atom(statement[2], names)}"
    if operator == "<=>":
        return f"{spell_atom(statement[1], names)} if and only if {spell_atom(statement[2], names)}"
    return spell_atom(statement, names)


def check_statement_shape(statement, speaker, num_people):
    """Depth <= 2, atoms in range, nobody calls themself a knave, distinct operands."""
    atoms = [statement] if statement[0] in ("telling-truth", "lying") else list(statement[1:])
    if statement[0] == "not":
        assert len(atoms) == 1
    elif statement[0] in ("and", "or"):
        assert len(atoms) == 2  # published width
    elif statement[0] in ("->", "<=>"):
        assert len(atoms) == 2
    assert len(set(atoms)) == len(atoms)
    for atom in atoms:
        assert atom[0] in ("telling-truth", "lying"), f"nesting deeper than 2 in {statement}"
        assert 0 <= atom[1] < num_people
        assert atom != ("lying", speaker)


def check_row(row, num_people):
    statements = ast.literal_eval(row["statements"])
    names = row["names"]
    solution = tuple(row["solution"])
    assert row["num_people"] == num_people == len(statements) == len(names) == len(solution)
    assert len(set(names)) == num_people and all(name.isalpha() for name in names)
    # Exactly one solution, and it is the stored one.
    assert brute_force_solutions(statements) == [solution]
    # The answer-format ground truth agrees with `solution` and `names`.
    expected_lines = [
        f"({index}) {name} is {'a knight' if knight else 'a knave'}"
        for index, (name, knight) in enumerate(zip(names, solution, strict=True), start=1)
    ]
    assert row["solution_text_format"] == "\n".join(expected_lines)
    for speaker, statement in enumerate(statements):
        check_statement_shape(statement, speaker, num_people)
    # The quiz states each person's claim (own rendering) in that person's sentence.
    sentences = re.split(r'(?<=[.?]")\s+|(?<=[.?])\s+(?=["A-Z])', row["quiz"])
    assert sentences[-1] == "So who is a knight and who is a knave?"
    claim_sentences = sentences[-1 - num_people : -1]
    assert len(claim_sentences) == num_people
    for speaker, (statement, sentence) in enumerate(zip(statements, claim_sentences, strict=True)):
        claim = spell(statement, names)
        position = sentence.lower().find(claim.lower())
        assert position >= 0, (claim, sentence)
        rest = sentence[:position] + sentence[position + len(claim) :]
        assert re.search(rf"\b{names[speaker]}\b", rest), (names[speaker], sentence)
    # Prompt: system instruction, the quiz, and the pre-filled <think> where asked for.
    prompt = row["prompt"]
    expected_roles = ["system", "user", "assistant"] if row["think_prefilled"] else ["system", "user"]
    assert [message["role"] for message in prompt] == expected_roles
    assert "<think>" in prompt[0]["content"] and "<answer>" in prompt[0]["content"]
    assert prompt[1]["content"] == row["quiz"]
    if row["think_prefilled"]:
        assert prompt[2]["content"] == "<think>"


# ---------------------------------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_people", range(2, 9))
def test_generated_puzzles_have_exactly_one_solution(num_people):
    for seed in range(6):
        dataset = kk.generate_dataset(num_people, 5, seed=seed)
        assert len(dataset) == 5
        rows = dataset.to_list()
        for row in rows:
            check_row(row, num_people)
        assert len({row["statements"] for row in rows}) == len(rows)  # no repeated puzzle


def test_generator_is_deterministic_for_a_seed():
    first = kk.generate_dataset([3, 5], 12, seed=7).to_list()
    assert first == kk.generate_dataset([3, 5], 12, seed=7).to_list()
    other = kk.generate_dataset([3, 5], 12, seed=8).to_list()
    assert [row["statements"] for row in first] != [row["statements"] for row in other]


def test_mixture_of_sizes():
    rows = kk.generate_dataset([3, 4, 7], 9, seed=1).to_list()
    assert [row["num_people"] for row in rows] == [3, 4, 7] * 3
    for row in rows:
        check_row(row, row["num_people"])


def test_small_sizes_run_out_of_new_puzzles_with_a_clear_error():
    # An independent count: all depth-2 statements for 2 people, pairs with a unique solution.
    def statements_of(speaker):
        atoms = [("telling-truth", 0), ("telling-truth", 1), ("lying", 0), ("lying", 1)]
        atoms = [atom for atom in atoms if atom != ("lying", speaker)]
        pairs = [(a, b) for a in atoms for b in atoms if a != b]
        compound = [(operator, a, b) for operator in ("and", "or", "->", "<=>") for a, b in pairs]
        return atoms + [("not", a) for a in atoms] + compound

    unique = sum(
        len(brute_force_solutions((first, second))) == 1 for first in statements_of(0) for second in statements_of(1)
    )
    assert len(kk.generate_dataset(2, 120, seed=0)) == 120
    with pytest.raises(RuntimeError, match="unique solution"):
        kk.generate_puzzles(2, unique + 1, seed=0, max_attempts=3000)


def test_every_statement_kind_occurs():
    rows = kk.generate_dataset([3, 5, 7], 60, seed=3).to_list()
    kinds = {statement[0] for row in rows for statement in ast.literal_eval(row["statements"])}
    assert kinds == {"telling-truth", "lying", "not", "and", "or", "->", "<=>"}
    # Claims are phrased in many ways (direct and reported speech).
    sentences = [sentence for row in rows for sentence in row["quiz"].split(". ")]
    assert sum('"' in sentence for sentence in sentences) > 0
    assert sum(" that " in sentence for sentence in sentences) > 0


def test_wider_statements():
    rows = kk.generate_dataset(5, 6, seed=2, max_width=3).to_list()
    widths = set()
    for row in rows:
        statements = ast.literal_eval(row["statements"])
        assert brute_force_solutions(statements) == [tuple(row["solution"])]
        widths |= {len(statement) - 1 for statement in statements if statement[0] in ("and", "or")}
    assert widths <= {2, 3} and 3 in widths


def test_prefilled_prompt_renders_to_text_that_continues_the_think(tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    dataset = kk.generate_dataset(3, 2, seed=0, prefill_think=True)
    assert dataset[0]["think_prefilled"] is True and dataset[0]["prompt"][-1] == {
        "role": "assistant",
        "content": "<think>",
    }
    rendered = kk.render_prompts_as_text(dataset, tokenizer)
    for row, original in zip(rendered, dataset, strict=True):
        text = row["prompt"]
        assert isinstance(text, str) and original["quiz"] in text
        # the assistant turn is opened once and left open at "<think>": no end-of-turn after it, no second turn
        assert text.endswith("<|im_start|>assistant\n<think>")
        assert text.count("<|im_start|>assistant") == 1
    plain = kk.render_prompts_as_text(kk.generate_dataset(3, 1, seed=0), tokenizer)
    assert plain[0]["prompt"].endswith("<|im_start|>assistant\n")


def test_prompt_without_prefill():
    row = kk.generate_dataset(3, 1, seed=0, prefill_think=False, system_prompt="SYS")[0]
    assert row["prompt"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": row["quiz"]}]
    assert row["think_prefilled"] is False


@pytest.mark.parametrize("bad", [1, 9, 0, [3, 9], []])
def test_num_people_out_of_range(bad):
    with pytest.raises(ValueError):
        kk.generate_dataset(bad, 2)


def test_module_solver_agrees_with_brute_force_on_random_statements():
    rng = random.Random(0)
    for _ in range(300):
        num_people = rng.randint(2, 6)
        statements = tuple(kk.sample_statement(rng, speaker, num_people) for speaker in range(num_people))
        assert sorted(kk.solve(statements)) == sorted(brute_force_solutions(statements))


# ---------------------------------------------------------------------------------------------------------------------
# Published data (local files in the Hub's format)
# ---------------------------------------------------------------------------------------------------------------------
PUBLISHED_ROWS = [
    {
        "quiz": "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and "
        'knaves always lie. You meet 3 inhabitants: Michael, Zoey, and Ethan. Michael was heard saying, "Ethan is a '
        'knight if and only if Michael is a knight". "Zoey is a knight or Ethan is a knight," Zoey mentioned. Ethan '
        'asserted: "Michael is a knave if and only if Zoey is a knave". So who is a knight and who is a knave?',
        "names": ["Michael", "Zoey", "Ethan"],
        "knight_knave": {
            "knight": "knight",
            "knave": "knave",
            "a_knight": "a knight",
            "a_knave": "a knave",
            "Knight": "Knight",
            "Knave": "Knave",
        },
        "solution": [True, True, True],
        "solution_text": "Michael is a knight, Zoey is a knight, and Ethan is a knight.",
        "solution_text_format": "(1) Michael is a knight\n(2) Zoey is a knight\n(3) Ethan is a knight",
        "cot_head": "Let's think step by step.",
        "cot_repeat_steps": ["Assume Michael is a knight."],
        "cot_foot": "This leads to a feasible solution.",
        "statements": "(('<=>', ('telling-truth', 2), ('telling-truth', 0)), ('or', ('telling-truth', 1), "
        "('telling-truth', 2)), ('<=>', ('lying', 0), ('lying', 1)))",
        "index": 0,
    },
    {
        "quiz": "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and "
        "knaves always lie. You meet 7 inhabitants: Harper, Benjamin, Olivia, Daniel, Henry, Jackson, and Sebastian. "
        'According to Harper, "Sebastian is a knave if and only if Henry is a knight". Benjamin asserted: "Henry is a '
        'knight if and only if Olivia is a knight". Olivia commented, "Benjamin is a knave and Daniel is a knave". '
        'Daniel stated, "Jackson is a knave". Henry told you that Olivia is not a knight. Jackson said that Harper is '
        "a knight and Benjamin is a knight. Sebastian told you that Daniel is a knight and Jackson is a knight. So "
        "who is a knight and who is a knave?",
        "names": ["Harper", "Benjamin", "Olivia", "Daniel", "Henry", "Jackson", "Sebastian"],
        "knight_knave": {
            "knight": "knight",
            "knave": "knave",
            "a_knight": "a knight",
            "a_knave": "a knave",
            "Knight": "Knight",
            "Knave": "Knave",
        },
        "solution": [True, False, False, True, True, False, False],
        "solution_text": "Harper is a knight, Benjamin is a knave, Olivia is a knave, Daniel is a knight, Henry is a "
        "knight, Jackson is a knave, and Sebastian is a knave.",
        "solution_text_format": "(1) Harper is a knight\n(2) Benjamin is a knave\n(3) Olivia is a knave\n(4) Daniel "
        "is a knight\n(5) Henry is a knight\n(6) Jackson is a knave\n(7) Sebastian is a knave",
        "cot_head": "",
        "cot_repeat_steps": [],
        "cot_foot": "",
        "statements": "(('<=>', ('lying', 6), ('telling-truth', 4)), ('<=>', ('telling-truth', 4), ('telling-truth', "
        "2)), ('and', ('lying', 1), ('lying', 3)), ('lying', 5), ('not', ('telling-truth', 2)), ('and', "
        "('telling-truth', 0), ('telling-truth', 1)), ('and', ('telling-truth', 3), ('telling-truth', 5)))",
        "index": 1000,
    },
]


@pytest.fixture
def published_jsonl(tmp_path):
    path = tmp_path / "people3_7.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PUBLISHED_ROWS))
    return path


def test_published_format_maps_to_generator_columns(published_jsonl):
    import datasets

    raw = datasets.load_dataset("json", data_files=str(published_jsonl), split="train")
    dataset = kk.prepare_knights_knaves_dataset(raw)
    generated = kk.generate_dataset(3, 1, seed=0)
    assert set(dataset.column_names) == set(generated.column_names)
    for row in dataset.to_list():
        check_row(row, len(row["names"]))
    assert dataset[0]["statements"] == PUBLISHED_ROWS[0]["statements"]
    assert dataset[0]["solution_text"] == PUBLISHED_ROWS[0]["solution_text"]


def test_hub_loader_uses_the_published_names(published_jsonl, monkeypatch):
    import datasets

    local = datasets.load_dataset("json", data_files=str(published_jsonl), split="train")
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split, kwargs))
        return local

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dataset = kk.load_knights_knaves_dataset([3, 7], split="test", source="hub", revision="main")
    assert calls == [
        ("K-and-K/knights-and-knaves", "test", "3ppl", {"revision": "main"}),
        ("K-and-K/knights-and-knaves", "test", "7ppl", {"revision": "main"}),
    ]
    assert len(dataset) == 2 * len(local)
    assert dataset[0]["prompt"][1]["content"] == PUBLISHED_ROWS[0]["quiz"]


# ---------------------------------------------------------------------------------------------------------------------
# Reward (expected values from the spec: format +1/-1; answer +2 / -1.5 / -2, -2 when the format fails)
# ---------------------------------------------------------------------------------------------------------------------
TRUTH = "(1) Max is a knight\n(2) Maxwell is a knave\n(3) Ella is a knight"
RIGHT = "(1) Max is a knight\n(2) Maxwell is a knave\n(3) Ella is a knight"
WRONG = "(1) Max is a knave\n(2) Maxwell is a knave\n(3) Ella is a knight"


def wrap(answer, think="The puzzle says so."):
    return f"<think>{think}</think>\n<answer>{answer}</answer>"


REWARD_CASES = [
    # (id, completion, think_prefilled, expected format, expected answer)
    ("correct", wrap(RIGHT), False, 1.0, 2.0),
    ("wrong identity", wrap(WRONG), False, 1.0, -1.5),
    ("all wrong", wrap("(1) Max is a knave\n(2) Maxwell is a knight\n(3) Ella is a knave"), False, 1.0, -1.5),
    ("person missing", wrap("(1) Max is a knight\n(2) Maxwell is a knave"), False, 1.0, -2.0),
    ("extra role word", wrap(RIGHT + "\nEveryone else is a knight"), False, 1.0, -2.0),
    (
        "same-prefix name only",
        wrap("(1) Maxwell is a knight\n(2) Maxwell is a knave\n(3) Ella is a knight"),
        False,
        1.0,
        -2.0,
    ),
    (
        "same-prefix names reversed",
        wrap("(1) Maxwell is a knave\n(2) Ella is a knight\n(3) Max is a knight"),
        False,
        1.0,
        2.0,
    ),
    ("case differences", wrap("MAX IS A KNIGHT\nmaxwell is a KNAVE\nElla Is A Knight"), False, 1.0, 2.0),
    ("plural role", wrap("(1) Max is a knights\n(2) Maxwell is a knave\n(3) Ella is a knight"), False, 1.0, -2.0),
    ("prose answer", wrap("Max is a knight, Maxwell is a knave, and Ella is a knight."), False, 1.0, 2.0),
    ("empty answer", wrap(""), False, 1.0, -2.0),
    ("no tags", RIGHT, False, -1.0, -2.0),
    ("upper-case tags", f"<THINK>x</THINK><ANSWER>{RIGHT}</ANSWER>", False, -1.0, -2.0),
    ("no think", f"<answer>{RIGHT}</answer>", False, -1.0, -2.0),
    ("two answers", wrap(RIGHT) + f"<answer>{RIGHT}</answer>", False, -1.0, -2.0),
    ("two thinks", "<think>a</think><think>b</think>" + f"<answer>{RIGHT}</answer>", False, -1.0, -2.0),
    ("answer before think", f"<answer>{RIGHT}</answer><think>x</think>", False, -1.0, -2.0),
    ("close before open", f"</think>x<think><answer>{RIGHT}</answer>", False, -1.0, -2.0),
    ("answer tags reversed", f"<think>x</think></answer>{RIGHT}<answer>", False, -1.0, -2.0),
    ("unclosed answer", f"<think>x</think><answer>{RIGHT}", False, -1.0, -2.0),
    ("prefilled think", f"Max says...</think><answer>{RIGHT}</answer>", True, 1.0, 2.0),
    ("prefilled think, wrong", f"Max says...</think><answer>{WRONG}</answer>", True, 1.0, -1.5),
    ("prefilled think not counted", f"Max says...</think><answer>{RIGHT}</answer>", False, -1.0, -2.0),
    ("think repeated after prefill", wrap(RIGHT), True, -1.0, -2.0),
    ("conversational", [{"role": "assistant", "content": wrap(RIGHT)}], False, 1.0, 2.0),
    (
        "conversational prefilled",
        [{"role": "assistant", "content": f"x</think><answer>{WRONG}</answer>"}],
        True,
        1.0,
        -1.5,
    ),
    ("content parts", [{"role": "assistant", "content": [{"type": "text", "text": wrap(RIGHT)}]}], False, 1.0, 2.0),
    ("None", None, False, -1.0, -2.0),
]


@pytest.mark.parametrize(
    "completion, think_prefilled, expected_format, expected_answer",
    [case[1:] for case in REWARD_CASES],
    ids=[case[0] for case in REWARD_CASES],
)
def test_reward_table(completion, think_prefilled, expected_format, expected_answer):
    kwargs = {"completions": [completion], "solution_text_format": [TRUTH], "think_prefilled": think_prefilled}
    assert kk.knights_knaves_format_reward(**kwargs) == [expected_format]
    assert kk.knights_knaves_answer_reward(**kwargs) == [expected_answer]
    assert kk.knights_knaves_reward(**kwargs) == [expected_format + expected_answer]
    assert expected_format + expected_answer in (3.0, -0.5, -1.0, -3.0)


# The authors' scorer splits the decoded prompt + response at the first literal "Assistant:". Expected totals obtained
# by running their `verl/utils/reward_score/kk.py` (zhyang2226/AR-Lopti @ cbeb333) in a scratch environment outside
# this project on `paper_prompt(quiz) + completion + "<|im_end|>"` with this TRUTH.
ASSISTANT_SPLIT_CASES = [
    (f"The puzzle says so.</think>\n<answer>{RIGHT}</answer>", 3.0),
    (f"Assistant: <think>x</think><answer>{RIGHT}</answer>", 3.0),  # scored from the split: no pre-filled <think>
    (f"x</think><answer>{RIGHT}</answer> Assistant: done", -3.0),  # only " done" is scored
    (f"Assistant: a Assistant: <think>x</think><answer>{RIGHT}</answer>", 3.0),  # the first "Assistant:" splits
    (f"x</think>Assistant: <answer>{RIGHT}</answer>", -3.0),
    (f"Assistant:<think>x</think><answer>{WRONG}</answer>", -0.5),
]


def test_reward_splits_at_the_first_assistant_marker_as_the_authors_scorer():
    completions = [completion for completion, _ in ASSISTANT_SPLIT_CASES]
    expected = [total for _, total in ASSISTANT_SPLIT_CASES]
    truths = [TRUTH] * len(completions)
    assert kk.knights_knaves_reward(completions, truths, think_prefilled=True) == expected
    parts = zip(
        kk.knights_knaves_format_reward(completions, think_prefilled=True),
        kk.knights_knaves_answer_reward(completions, truths, think_prefilled=True),
        strict=True,
    )
    assert [format_score + answer_score for format_score, answer_score in parts] == expected


def test_reward_per_completion_prefill_flags_and_trl_kwargs():
    completions = [f"x</think><answer>{RIGHT}</answer>", wrap(RIGHT)]
    logged = []
    rewards = kk.knights_knaves_reward(
        prompts=["p", "p"],
        completions=completions,
        completion_ids=[[1], [2]],
        solution_text_format=[TRUTH, TRUTH],
        think_prefilled=[True, False],
        names=[["Max", "Maxwell", "Ella"]] * 2,
        trainer_state=None,
        log_metric=lambda name, value: logged.append((name, value)),
    )
    assert rewards == [3.0, 3.0]
    assert dict(logged) == {"knights_knaves/format": 1.0, "knights_knaves/answer": 2.0, "knights_knaves/accuracy": 1.0}


def test_sub_rewards_sum_to_the_reward_on_random_tag_soup():
    rng = random.Random(0)
    answers = [RIGHT, WRONG, "Max is a knight", "", "(1) Max is a knight (2) Maxwell is a knave (3) Ella is a"]
    completions = []
    for _ in range(400):
        tags = ["<think>", "</think>", "<answer>", "</answer>"]
        if rng.random() < 0.4:  # break the format: drop, repeat or swap a tag
            index = rng.randrange(4)
            mutation = rng.choice(["drop", "repeat", "swap"])
            if mutation == "drop":
                tags.pop(index)
            elif mutation == "repeat":
                tags.insert(index, tags[index])
            else:
                other = rng.randrange(4)
                tags[index], tags[other] = tags[other], tags[index]
        fillers = ["x", rng.choice(answers), "\n"]
        completions.append("".join(tag + rng.choice(fillers) for tag in tags))
    for prefilled in (False, True):
        kwargs = {"completions": completions, "solution_text_format": [TRUTH] * 400, "think_prefilled": prefilled}
        total = kk.knights_knaves_reward(**kwargs)
        parts = zip(kk.knights_knaves_format_reward(**kwargs), kk.knights_knaves_answer_reward(**kwargs), strict=True)
        assert total == [format_score + answer_score for format_score, answer_score in parts]
        assert set(total) <= {3.0, -0.5, -1.0, -3.0}
    assert {3.0, -0.5, -1.0, -3.0} <= set(kk.knights_knaves_reward(completions, [TRUTH] * 400))


def test_reward_on_generated_puzzles():
    dataset = kk.generate_dataset([3, 7], 10, seed=5)
    completions, flipped = [], []
    for row in dataset:
        # Answers built from `names` and `solution` (not from `solution_text_format`).
        people = zip(row["names"], row["solution"], strict=True)
        lines = [f"({i}) {name} is a {'knight' if knight else 'knave'}" for i, (name, knight) in enumerate(people, 1)]
        completions.append("I checked every case.</think><answer>" + "\n".join(lines) + "</answer>")
        last = lines[-1]
        lines[-1] = last.replace("knight", "KNAVE") if "knight" in last else last.replace("knave", "knight")
        flipped.append("Hmm.</think><answer>" + "\n".join(lines) + "</answer>")
    columns = {"solution_text_format": dataset["solution_text_format"], "think_prefilled": dataset["think_prefilled"]}
    assert kk.knights_knaves_reward(completions, **columns) == [3.0] * len(dataset)
    assert kk.knights_knaves_reward(flipped, **columns) == [-0.5] * len(dataset)


# ---------------------------------------------------------------------------------------------------------------------
# A short GRPO run with the K&K reward on a tiny model
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_short_grpo_run_with_knights_knaves_reward(tmp_path):
    from transformers import AutoTokenizer

    from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer
    from trl_lopti.models import build_tiny_model

    model_path = build_tiny_model(tmp_path / "tiny")
    # A short system prompt keeps the sequences (and the run) short with the tiny byte-level tokenizer.
    system_prompt = "Think in <think> </think>, answer in <answer> </answer>."
    # The paper's format: generation starts after a pre-filled <think>. GRPOTrainer never continues a final
    # assistant message, so the prompts are rendered to text first.
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    conversational = kk.generate_dataset(3, 8, seed=0, system_prompt=system_prompt, prefill_think=True)
    train_dataset = kk.render_prompts_as_text(conversational, tokenizer)
    assert train_dataset[0]["prompt"].endswith("<|im_start|>assistant\n<think>")
    args = LoptiGRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
        # Train on format + answer; the combined reward rides along with weight 0 to check its logged parts.
        reward_weights=[1.0, 1.0, 0.0],
    )
    trainer = LoptiGRPOTrainer(
        model=model_path,
        reward_funcs=[kk.knights_knaves_format_reward, kk.knights_knaves_answer_reward, kk.knights_knaves_reward],
        args=args,
        train_dataset=train_dataset,
    )
    trainer.train()
    assert trainer.state.global_step == 2
    # Each part is logged (once per generation batch; Lopti trains each batch in two passes).
    logs = [entry for entry in trainer.state.log_history if "rewards/knights_knaves_format_reward/mean" in entry]
    assert len(logs) >= 1
    for entry in logs:
        format_mean = entry["rewards/knights_knaves_format_reward/mean"]
        answer_mean = entry["rewards/knights_knaves_answer_reward/mean"]
        assert -1.0 <= format_mean <= 1.0 and -2.0 <= answer_mean <= 2.0
        assert entry["reward"] == pytest.approx(format_mean + answer_mean, abs=1e-5)
        assert entry["rewards/knights_knaves_reward/mean"] == pytest.approx(format_mean + answer_mean, abs=1e-5)
        assert entry["knights_knaves/format"] == pytest.approx(format_mean, abs=1e-5)
        assert entry["knights_knaves/answer"] == pytest.approx(answer_mean, abs=1e-5)
