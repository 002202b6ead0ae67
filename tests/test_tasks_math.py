"""Math: the paper's grading (garbage, the first `</think>`, the required box, time limits in and outside the main
thread), the lenient one (TRL's `accuracy_reward` behind an adapter: equivalent forms, references that are bare LaTeX,
numbers or lists) and the loaders (the authors' DSR-uniform file in their verl format, written here; local files in
each Hub set's format)."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import math_verify  # noqa: F401  (the test extra installs it: a missing math-verify fails here, not skips)
import pytest

from trl_lopti.tasks import _time_limit
from trl_lopti.tasks import math as math_task
from trl_lopti.tasks.math import math_reward, math_reward_lenient


# A sum of 59 rational terms: sympy needs more than 10 s to compare it with SLOW_REFERENCE in both grading modes (pure
# Python, so it can be interrupted). The timeout tests check that the limit was reached, so they fail if this stops
# being slow.
SLOW_ANSWER = "\\boxed{" + "+".join(f"{i}/(x+{i})" for i in range(1, 60)) + "}"
SLOW_REFERENCE = "x^2+1"


# ---------------------------------------------------------------------------------------------------------------------
# Equivalent forms and wrong answers (math-verify's equivalence, through TRL's accuracy_reward: the lenient grader; the
# paper's grader is checked against the authors' own output in tests/test_tasks_math_paper.py). The references are as
# datasets hold them (bare LaTeX, numbers, lists), which TRL's reward alone does not parse.
# ---------------------------------------------------------------------------------------------------------------------
EQUIVALENT = [
    ("\\frac{1}{2}", "So the answer is $\\boxed{0.5}$."),
    ("\\frac{1}{2}", "\\boxed{1/2}"),
    ("0.5", "\\boxed{\\dfrac{1}{2}}"),
    ("\\frac12", "\\boxed{\\frac{1}{2}}"),
    ("\\frac{3}{4}", "\\boxed{0.75}"),
    ("-\\frac{2}{3}", "\\boxed{\\frac{-2}{3}}"),
    ("204", "The walk takes \\boxed{204} minutes."),
    (142.0, "\\boxed{142}"),
    ("9.6\n", "\\boxed{9.6}"),
    ("3\\sqrt{2}", "\\boxed{\\sqrt{18}}"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),
    ("e^{x^2}", "\\boxed{\\exp(x^2)}"),
    ("2^{2023} - 1", "\\boxed{2^{2023}-1}"),
    ("5", "\\boxed{x = 5}"),
    ("(1, 2]", "\\boxed{(1,2]}"),
    ("[0, \\infty)", "\\boxed{[0,\\infty)}"),
    ("(-\\infty, 0) \\cup (1, \\infty)", "\\boxed{(-\\infty,0)\\cup(1,\\infty)}"),
    ("\\{1, 2, 3\\}", "\\boxed{\\{3, 2, 1\\}}"),
    (["$3$", "$5$"], "\\boxed{5, 3}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi/2)}"),
    ("\\text{(C)}", "\\boxed{C}"),
    ("\\boxed{7}", "\\boxed{7}"),
]

WRONG = [
    ("\\frac{1}{2}", "\\boxed{0.51}"),
    ("\\frac{1}{2}", "\\boxed{2}"),
    ("204", "\\boxed{205}"),
    ("(1, 2]", "\\boxed{[1,2]}"),
    ("(1, 2]", "\\boxed{(1,2)}"),
    ("\\{1, 2, 3\\}", "\\boxed{\\{1, 2\\}}"),
    ("x^2+2x+1", "\\boxed{(x-1)^2}"),
    ("3\\sqrt{2}", "\\boxed{2\\sqrt{3}}"),
    ("2", "there is no answer here"),
]


@pytest.mark.parametrize("solution, completion", EQUIVALENT)
def test_equivalent_forms_are_accepted(solution, completion):
    assert math_reward_lenient([completion], [solution]) == [1.0]


@pytest.mark.parametrize("solution, completion", WRONG)
def test_wrong_answers_are_rejected(solution, completion):
    assert math_reward_lenient([completion], [solution]) == [0.0]
    assert math_reward([completion], [solution]) == [0.0]


def test_last_box_after_thinking_is_the_answer():
    solution = ["7"] * 5
    completions = [
        "First guess \\boxed{3}, but checking again it is \\boxed{7}.",
        "First guess \\boxed{7}, but checking again it is \\boxed{3}.",
        "<think>maybe \\boxed{7}</think> The answer is \\boxed{8}.",
        "<think>maybe \\boxed{8}</think> The answer is \\boxed{7}.",
        "The answer is \\boxed{7}, and a broken box \\boxed{3",
    ]
    assert math_reward(completions, solution) == [1.0, 0.0, 0.0, 1.0, 0.0]  # the authors': an unclosed last box is 0
    # math-verify reads two different boxes as the set {3, 7}; it grades the text after the last </think>
    assert math_reward_lenient(completions, solution) == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_paper_grading_reads_the_text_after_the_first_think_close():
    # The authors grade `response.split("</think>")[1]`: the part between the first and the second `</think>`.
    completions = [
        "<think>a</think> \\boxed{7} <think>b</think> \\boxed{8}",
        "<think>a</think> \\boxed{8} <think>b</think> \\boxed{7}",
        "<think>a</think></think>\\boxed{7}",
    ]
    assert math_reward(completions, ["7"] * 3) == [1.0, 0.0, 0.0]
    assert math_reward_lenient(completions, ["7"] * 3) == [0.0, 1.0, 1.0]  # the text after the last </think>


def test_paper_grading_needs_a_box_and_lenient_grading_does_not():
    completions = ["The final answer is $2$.", "<think>2</think> so 2", "\\boxed{2}", "no box, but the answer is $2$"]
    assert math_reward(completions, ["2"] * 4) == [0.0, 0.0, 1.0, 0.0]
    # TRL's reward reads an unboxed answer in $...$ or after "the final answer is", not a bare number
    assert math_reward_lenient(completions, ["2"] * 4) == [1.0, 0.0, 1.0, 1.0]
    assert math_reward_lenient(["there is no answer here"], ["2"]) == [0.0]


def test_conversational_completions():
    completions = [
        [{"role": "assistant", "content": "Thus $\\boxed{\\frac{1}{4}}$."}],
        [{"role": "assistant", "content": [{"type": "text", "text": "Thus $\\boxed{0.25}$."}]}],
        [{"role": "assistant", "content": "Thus $\\boxed{0.3}$."}],
    ]
    assert math_reward(completions, ["1/4"] * 3) == [1.0, 1.0, 0.0]


def test_normalize_reference():
    assert math_task.normalize_reference(142.0) == "142"
    assert math_task.normalize_reference(2.5) == "2.5"
    assert math_task.normalize_reference(["$3$", "$5$"]) == "3, 5"
    assert math_task.normalize_reference({"value": " 7 ", "pass_at_n": 0.5}) == "7"
    assert math_task.normalize_reference("$\\frac{1}{2}$\n") == "\\frac{1}{2}"


# ---------------------------------------------------------------------------------------------------------------------
# Garbage scores 0 without an exception
# ---------------------------------------------------------------------------------------------------------------------
GARBAGE = [
    None,
    123,
    {"content": None},
    [],
    "",
    "\\boxed{",
    "\\boxed{}",
    "$$$\\\\\\frac{{{",
    "\\boxed{\\frac{}{}}",
    "\\boxed{\\left( 1, 2 \\right.}",
    "\\boxed{\\sqrt[}{]}",
    "\\boxed{" + "{" * 3000 + "}" * 3000 + "}",
    "\\boxed{" + "(" * 500 + "1" + ")" * 500 + "}",
    "\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}",  # parsed, runs into the time limit
    "\\boxed{" + "\\frac{1}{" * 60 + "2" + "}" * 60 + "}",  # parsed, runs into the time limit
    "x" * 200_000,
    "\\boxed{" + "1+" * 2000 + "1}",
    "\\boxed{1/0}",
    "\\boxed{\\infty - \\infty}",
    "\\boxed{2^{2^{40}}}",
    "\\boxed{10^{10^{10}}}",
    "\\boxed{9^{123456789}}",
    "\\boxed{1000000!}",
    "\ud800\x00\\boxed{\x00}",
]


def test_garbage_scores_zero_without_exception():
    started = time.monotonic()
    assert math_reward(GARBAGE, ["5"] * len(GARBAGE), timeout_seconds=1.0) == [0.0] * len(GARBAGE)
    assert time.monotonic() - started < 30.0


@pytest.mark.parametrize("solution", ["\\boxed{", "", None, "$$", "\\frac{{"])
def test_garbage_reference_scores_zero(solution):
    assert math_reward(["\\boxed{1}"], [solution]) == [0.0]


def test_looks_explosive():
    explosive = ["2^{2^{40}}", "10^{10^{10}}", "9^{123456789}", "2**(3**100)", "1000000!", "2^{100!}", "7^{ 1234567}"]
    harmless = [
        "2^{10}",
        "2^{2023} - 1",
        "x^2 + 1",
        "\\frac{1}{2}",
        "100!",
        "(x+1)^{40}",
        "3^{12345}",
        "e^{x^2}",
        "2^{x^2}",
        "e^{e^{x}}",
        "10^{-3}",
        "1234567",
    ]
    assert [math_task.looks_explosive(text) for text in explosive] == [True] * len(explosive)
    assert [math_task.looks_explosive(text) for text in harmless] == [False] * len(harmless)


# ---------------------------------------------------------------------------------------------------------------------
# Time limits, in the main thread and outside it
# ---------------------------------------------------------------------------------------------------------------------
def test_timeout_in_main_thread():
    assert threading.current_thread() is threading.main_thread()
    assert math_reward(["\\boxed{1}"], ["1"]) == [1.0]  # warm math-verify's parser up
    started = time.monotonic()
    rewards = math_reward([SLOW_ANSWER, "\\boxed{\\frac{1}{2}}"], [SLOW_REFERENCE, "0.5"], timeout_seconds=1.5)
    assert rewards == [0.0, 1.0]
    assert 1.5 <= time.monotonic() - started < 6.0


def test_previous_alarm_is_restored():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        started = time.monotonic()
        assert math_reward([SLOW_ANSWER], [SLOW_REFERENCE], timeout_seconds=0.3) == [0.0]
        assert time.monotonic() - started >= 0.3
        assert signal.getsignal(signal.SIGALRM) is not None and not fired
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_reward_outside_the_main_thread():
    completions = [SLOW_ANSWER, "\\boxed{0.5}", "\\boxed{(1,2]}", "\\boxed{3}", "\\boxed{"]
    solutions = [SLOW_REFERENCE, "\\frac{1}{2}", "(1, 2]", "4", "1"]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(math_reward, completions, solutions, timeout_seconds=1.5)
        second = pool.submit(math_reward, completions[1:], solutions[1:], timeout_seconds=1.5)
        assert first.result(timeout=60) == [0.0, 1.0, 1.0, 0.0, 0.0]
        assert second.result(timeout=60) == [1.0, 1.0, 0.0, 0.0]
    assert 1.5 <= time.monotonic() - started < 30.0  # includes starting the worker process
    # Outside the main thread the checks ran in the worker process, which survived the timeout.
    worker = _time_limit._workers[math_task.grading.WORKER_TARGET]
    assert worker._process is not None and worker._process.poll() is None


def test_worker_process_is_killed_when_stuck_and_restarted(monkeypatch):
    worker = _time_limit.WorkerProcess(math_task.grading.WORKER_TARGET, ("\\boxed{1}", ["1"], None))
    try:
        assert worker.call(("\\boxed{0.5}", ["\\frac{1}{2}"], 2.0), 2.0) == 1.0
        first_process = worker._process
        # The parent stops waiting before the child's own time limit: the child is killed.
        monkeypatch.setattr(_time_limit, "WORKER_GRACE_SECONDS", -1.7)
        started = time.monotonic()
        assert worker.call((SLOW_ANSWER, [SLOW_REFERENCE], 2.0), 2.0) is None
        assert 0.3 <= time.monotonic() - started < 2.0
        assert worker._process is None and first_process.poll() is not None
        monkeypatch.setattr(_time_limit, "WORKER_GRACE_SECONDS", 1.0)
        assert worker.call(("\\boxed{(1,2]}", ["(1, 2]"], 2.0), 2.0) == 1.0  # a new child
        assert worker._process is not first_process
    finally:
        worker.close()


def test_time_limit_in_a_helper_thread_stops_pure_python_work():
    def spin():
        while True:
            pass

    baseline = threading.active_count()
    started = time.monotonic()
    with pytest.raises(math_task.DeadlineExceeded):
        _time_limit._run_in_thread(spin, 0.2)
    assert time.monotonic() - started < 2.0
    deadline = time.monotonic() + 5.0
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == baseline  # the helper was stopped, not leaked
    assert _time_limit._run_in_thread(lambda: 42, 1.0) == 42


def test_time_limit_with_alarm():
    def spin():
        while True:
            pass

    started = time.monotonic()
    with pytest.raises(math_task.DeadlineExceeded):
        math_task.run_with_time_limit(spin, 0.2)
    assert time.monotonic() - started < 2.0
    assert math_task.run_with_time_limit(lambda: "done", 1.0) == "done"


# ---------------------------------------------------------------------------------------------------------------------
# Datasets: local files in each Hub set's format, through the same mapping as the Hub path
# ---------------------------------------------------------------------------------------------------------------------
SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


LOCAL_SETS = {
    "deepscaler": [
        {"problem": "What is $1+1$?", "answer": "2", "solution": "It is $\\boxed{2}$."},
        {"problem": "Half of one?", "answer": "\\frac{1}{2}", "solution": "..."},
    ],
    "math500": [
        {
            "problem": "Compute $3 \\cdot 4$.",
            "answer": "12",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "test/algebra/1.json",
            "solution": "...",
        }
    ],
    "aime24": [{"id": 60, "problem": "Find $x$.", "solution": "...", "answer": "204", "url": "u", "year": "2024"}],
    "amc": [{"id": 0, "problem": "Find $m+n$.", "answer": 142.0, "url": "u"}],
    "minerva": [{"question": "Wavelength in Angstroms?", "answer": "9.6\n"}],
    "olympiadbench": [
        {"id": 1, "question": "Which numbers?", "final_answer": ["$3$", "$5$"], "is_multiple_answer": True}
    ],
    "aime": [
        {"ID": "2020-I-1", "Year": 2020, "Problem Number": 1, "Question": "Old problem.", "Answer": "39", "Part": "I"},
        {
            "ID": "2021-I-1",
            "Year": 2021,
            "Problem Number": 1,
            "Question": "Zou and Chou?",
            "Answer": "97",
            "Part": "I",
        },
        {
            "ID": "2024-II-15",
            "Year": 2024,
            "Problem Number": 15,
            "Question": "Rectangles?",
            "Answer": "315",
            "Part": "II",
        },
    ],
}

EXPECTED = {  # (problem, solution) per kept row, written out by hand
    "deepscaler": [("What is $1+1$?", "2"), ("Half of one?", "\\frac{1}{2}")],
    "math500": [("Compute $3 \\cdot 4$.", "12")],
    "aime24": [("Find $x$.", "204")],
    "amc": [("Find $m+n$.", "142")],
    "minerva": [("Wavelength in Angstroms?", "9.6")],
    "olympiadbench": [("Which numbers?", "3, 5")],
    "aime": [("Zou and Chou?", "97"), ("Rectangles?", "315")],
}


@pytest.mark.parametrize("name", sorted(LOCAL_SETS))
def test_load_math_dataset_from_local_files(name, tmp_path):
    extension = "parquet" if name == "olympiadbench" else "jsonl"
    path = tmp_path / f"{name}.{extension}"
    if extension == "parquet":
        import datasets

        datasets.Dataset.from_list(LOCAL_SETS[name]).to_parquet(str(path))
    else:
        write_jsonl(path, LOCAL_SETS[name])
    dataset = math_task.load_math_dataset(name, data_files=str(path))
    assert dataset.column_names == ["prompt", "problem", "solution"]
    assert [(row["problem"], row["solution"]) for row in dataset] == EXPECTED[name]
    for row, (problem, _solution) in zip(dataset, EXPECTED[name], strict=True):
        assert row["prompt"] == [{"role": "user", "content": f"{problem} {SUFFIX}"}]
    # The mapped rows feed the reward directly.
    boxed = [f"\\boxed{{{solution}}}" for _, solution in EXPECTED[name]]
    assert math_reward(boxed, dataset["solution"]) == [1.0] * len(dataset)


def test_orz_pairs_from_local_file(tmp_path):
    pairs = [
        [{"from": "human", "value": "Compute $2^5$."}, {"from": "assistant", "ground_truth": {"value": "32"}}],
        [
            {"from": "human", "value": "Simplify $\\frac{6}{8}$."},
            {"from": "assistant", "ground_truth": {"value": "\\frac{3}{4}", "pass_at_n": 0.5}},
        ],
    ]
    path = tmp_path / "orz_math_57k_collection.json"
    path.write_text(json.dumps(pairs))
    dataset = math_task.load_math_dataset("orz", data_files=str(path), system_prompt="Be precise.")
    assert [(row["problem"], row["solution"]) for row in dataset] == [
        ("Compute $2^5$.", "32"),
        ("Simplify $\\frac{6}{8}$.", "\\frac{3}{4}"),
    ]
    assert dataset[0]["prompt"] == [
        {"role": "system", "content": "Be precise."},
        {"role": "user", "content": f"Compute $2^5$. {SUFFIX}"},
    ]
    assert math_reward(["\\boxed{32}", "\\boxed{0.75}"], dataset["solution"]) == [1.0, 1.0]


def test_hub_names_and_splits(monkeypatch, tmp_path):
    import datasets
    import huggingface_hub

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        key = {spec.path: key for key, spec in math_task.MATH_DATASETS.items()}[path]
        return datasets.Dataset.from_list(LOCAL_SETS[key])

    orz_file = tmp_path / "orz.json"
    orz_file.write_text(json.dumps([[{"value": "Q"}, {"ground_truth": {"value": "1"}}]]))
    downloads = []

    def fake_download(repo_id, filename, repo_type=None, **kwargs):
        downloads.append((repo_id, filename, repo_type))
        return str(orz_file)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    for name in sorted(LOCAL_SETS):
        dataset = math_task.load_math_dataset(name)
        assert [(row["problem"], row["solution"]) for row in dataset] == EXPECTED[name]
    assert sorted(calls) == sorted(
        [
            ("agentica-org/DeepScaleR-Preview-Dataset", None, "train"),
            ("HuggingFaceH4/MATH-500", None, "test"),
            ("HuggingFaceH4/aime_2024", None, "train"),
            ("di-zhang-fdu/AIME_1983_2024", None, "train"),
            ("AI-MO/aimo-validation-amc", None, "train"),
            ("math-ai/minervamath", None, "test"),
            ("math-ai/olympiadbench", None, "test"),
        ]
    )
    orz = math_task.load_math_dataset("orz")
    assert downloads == [("Open-Reasoner-Zero/orz_math_57k_collection", "orz_math_57k_collection.json", "dataset")]
    assert orz[0]["solution"] == "1"
    with pytest.raises(ValueError, match="Unknown math dataset"):
        math_task.load_math_dataset("gsm8k")


# ---------------------------------------------------------------------------------------------------------------------
# The authors' math files (DSR-uniform): raw-text prompts, from parquet files written here in their verl format
# ---------------------------------------------------------------------------------------------------------------------
def verl_math_row(problem, answer, difficulty=None):
    extra_info = {"index": 0, "split": "train"}
    if difficulty is not None:
        extra_info["difficulty"] = difficulty
    return {
        "data_source": "deepscaler",
        "prompt": [{"content": f"{problem} {SUFFIX}", "role": "user"}],
        "ability": "math",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": extra_info,
    }


def write_parquet(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_paper_math_set_keeps_the_raw_text_prompt(tmp_path):
    rows = [verl_math_row("What is $1+1$?", "2", 3.5), verl_math_row("Half of one?", "\\frac{1}{2}", 71.25)]
    dataset = math_task.load_paper_math_dataset("dsr_uniform", write_parquet(tmp_path / "dsr.parquet", rows))
    assert dataset.column_names == ["prompt", "solution", "difficulty"]
    assert dataset["prompt"] == [f"What is $1+1$? {SUFFIX}", f"Half of one? {SUFFIX}"]  # text: no chat template
    assert dataset["solution"] == ["2", "\\frac{1}{2}"] and dataset["difficulty"] == [3.5, 71.25]
    # Graded as the paper grades: the boxed answer after the first </think>.
    completions = ["<think>1+1</think> \\boxed{2}", "<think>so 0.5</think> it is 0.5"]
    assert math_reward(completions, dataset["solution"]) == [1.0, 0.0]


def test_paper_math_set_errors_and_default_url(tmp_path, monkeypatch):
    alternatives = [verl_math_row("Speed?", ["0.01", "0.02"])]
    with pytest.raises(ValueError, match="2 alternative answers"):
        math_task.load_paper_math_dataset("aime_dsr", write_parquet(tmp_path / "alt.parquet", alternatives))
    with pytest.raises(ValueError, match="name: unknown paper math set 'minerva_dsr'"):
        math_task.load_paper_math_dataset("minerva_dsr")
    import datasets

    read = []
    monkeypatch.setattr(datasets, "load_dataset", lambda builder, data_files, split: read.append(data_files))
    with pytest.raises(AttributeError):  # the recorder returns no rows
        math_task.load_paper_math_dataset()
    assert read == [
        (
            "https://raw.githubusercontent.com/zhyang2226/AR-Lopti/cbeb333376decdfe571fa8613bdebcfcc526628d/"
            "data/deepscaler_c/deepscaler_uniform_train.parquet"
        )
    ]


def test_cli_builds_dsr_uniform_from_a_local_copy(tmp_path):
    from trl_lopti.cli.train import build_datasets, parse_train_args

    rows = [verl_math_row(f"Problem {i}?", str(i), float(i)) for i in range(5)]
    path = write_parquet(tmp_path / "dsr.parquet", rows)
    args = [
        "--task",
        "math",
        "--dataset_name",
        "dsr_uniform",
        "--math_data_file",
        path,
        "--model_name_or_path",
        "Qwen/Qwen2.5-7B",
        "--use_cpu",
        "true",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    script_args, training_args, _ = parse_train_args(args)
    train, evaluation = build_datasets(script_args, training_args)
    assert evaluation is None and train["prompt"] == [f"Problem {i}? {SUFFIX}" for i in range(5)]


def test_hub_sets_can_have_raw_text_prompts(tmp_path):
    path = tmp_path / "math500.jsonl"
    path.write_text(json.dumps({"problem": "  What is 2+2? ", "answer": "4"}) + "\n")
    text = math_task.load_math_dataset("math500", data_files=str(path), text_prompt=True)
    assert text["prompt"] == [f"What is 2+2? {SUFFIX}"]
    chat = math_task.load_math_dataset("math500", data_files=str(path))
    assert chat["prompt"] == [[{"role": "user", "content": f"What is 2+2? {SUFFIX}"}]]
    with pytest.raises(ValueError, match="system_prompt: a raw-text prompt"):
        math_task.make_math_prompt("x", system_prompt="S", text_prompt=True)
