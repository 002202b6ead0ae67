"""Math tasks of arXiv 2505.12929: the training and evaluation sets, and a verified-answer reward, for TRL.

The paper trains on DeepScaleR-Preview (and ORZ-57k) and evaluates on AIME, AMC, MATH-500, Minerva and OlympiadBench,
prompting with the problem followed by "Let's think step by step and output the final answer within \\boxed{}." (the
DeepScaleR prompt) and rewarding 1 for a correct final answer, 0 otherwise.

- [`math_reward`]: TRL reward function. Extracts the final answer (the last `\\boxed{...}`, with fallbacks) and checks
  it against the reference with `math-verify`, under a wall-clock limit; never raises.
- [`load_math_dataset`]: loads a set by short name from the Hub (see [`MATH_DATASETS`]) or from local files with the
  same columns, mapped to `prompt` + `solution`.

`math-verify` is an optional dependency: `pip install "trl_lopti[math]"`.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar


_T = TypeVar("_T")

MATH_PROMPT_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
"""Appended to every problem, as in the paper's (DeepScaleR's) math prompts."""

MAX_ANSWER_CHARS = 1_000
"""Longer extracted answers score 0 without being parsed (a guard against pathological inputs)."""

MAX_FALLBACK_CHARS = 2_000
"""Without a `\\boxed{}`, only this many final characters of the response are searched for an answer."""

_BOX_COMMANDS = ("\\boxed", "\\fbox")


@dataclass(frozen=True)
class MathDatasetSpec:
    """
    Where a math set lives on the Hugging Face Hub and which columns hold the problem and the reference answer.

    Args:
        path (`str`):
            Hub id.
        split (`str`):
            Split to load.
        problem_column (`str`):
            Column with the problem statement.
        answer_column (`str`):
            Column with the final answer (a string, a number, or a list of strings that together form the answer).
        name (`str` or `None`, *optional*):
            Config of the Hub dataset.
        year_column (`str` or `None`, *optional*):
            Column holding the year, to keep only `years`.
        years (`tuple[int, int]` or `None`, *optional*):
            Inclusive range of years to keep.
        data_file (`str` or `None`, *optional*):
            For sets stored as one JSON file of `[question, answer]` message pairs (ORZ) rather than as a table: the
            file's name in the Hub repository.
    """

    path: str
    split: str
    problem_column: str
    answer_column: str
    name: str | None = None
    year_column: str | None = None
    years: tuple[int, int] | None = None
    data_file: str | None = None


MATH_DATASETS: dict[str, MathDatasetSpec] = {
    # Training sets
    "deepscaler": MathDatasetSpec("agentica-org/DeepScaleR-Preview-Dataset", "train", "problem", "answer"),
    "orz": MathDatasetSpec(
        "Open-Reasoner-Zero/orz_math_57k_collection", "train", "value", "ground_truth",
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
}  # fmt: skip
"""The paper's math sets by short name. `"aime"` is AIME 2021-2024 (the paper's AIME set), `"aime24"` AIME 2024 only;
`"amc"` is AMC 2022-2023 (83 problems), `"minerva"` Minerva-Math (272), `"olympiadbench"` the 675 open-ended
English text-only math problems of OlympiadBench. Pass a [`MathDatasetSpec`] to [`load_math_dataset`] for another
mirror."""


# ---------------------------------------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------------------------------------
def completion_to_text(completion: Any) -> str:  # same as knights_knaves.completion_to_text; this file stands alone
    """
    The text of a completion, whether TRL passes it as a string or as a list of messages.

    Args:
        completion (`str`, `list[dict]` or `dict`):
            A plain-text completion, or conversational messages whose `content` is a string or a list of parts.

    Returns:
        `str`: The text (messages joined with newlines); `""` for anything unreadable.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content", "")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return ""
    if isinstance(completion, (list, tuple)):
        return "\n".join(completion_to_text(message) for message in completion)
    return ""


def _box_content(text: str, start: int) -> str | None:
    """Content of the box command starting at `start`, or `None` when its braces do not close."""
    position = start
    while position < len(text) and text[position].isalpha():  # skip the command's name
        position += 1
    while position < len(text) and text[position] == " ":
        position += 1
    if position >= len(text):
        return None
    if text[position] != "{":  # `\boxed 5`: the argument runs to the next `$` or whitespace
        end = position
        while end < len(text) and not text[end].isspace() and text[end] != "$":
            end += 1
        return text[position:end] or None
    depth = 0
    for end in range(position, len(text)):
        if text[end] == "{" and text[end - 1] != "\\":
            depth += 1
        elif text[end] == "}" and text[end - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[position + 1 : end]
    return None


def extract_boxed_answer(text: str) -> str | None:
    """
    The content of the last well-formed `\\boxed{...}` (or `\\fbox{...}`) in `text`.

    Nested braces are matched; `\\boxed 5` (no braces) is read up to the next space or `$`. A box whose braces never
    close is skipped in favour of the one before it.

    Args:
        text (`str`):
            A model response.

    Returns:
        `str` or `None`: The stripped content, `None` when no well-formed box exists.
    """
    starts = sorted(
        index
        for command in _BOX_COMMANDS
        for index in _find_all(text, command)
        if not text[index + len(command) : index + len(command) + 1].isalpha()  # `\boxed`, not `\boxedfoo`
    )
    for start in reversed(starts):
        content = _box_content(text, start + 1)
        if content is not None:
            return content.strip()
    return None


def _find_all(text: str, pattern: str) -> list[int]:
    positions, index = [], text.find(pattern)
    while index != -1:
        positions.append(index)
        index = text.find(pattern, index + 1)
    return positions


def _final_part(text: str) -> str:
    """The part after the last `</think>`, when the model wrote one: only the final answer section is graded."""
    marker = "</think>"
    return text.rsplit(marker, 1)[1] if marker in text else text


def normalize_reference(answer: Any) -> str:
    """
    A reference answer as a string: numbers without a spurious `.0`, lists joined with ", ", `$` and spaces removed
    at the ends.

    Args:
        answer (`Any`):
            A string (`"\\\\frac{1}{2}"`), a number (`142.0`) or a list of strings (`["$3$", "$5$"]`).

    Returns:
        `str`: The reference, ready for [`math_reward`].
    """
    if isinstance(answer, dict) and "value" in answer:  # ORZ's {"value": ..., "pass_at_n": ...}
        answer = answer["value"]
    if isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, float) and math.isfinite(answer) and answer.is_integer():
        return str(int(answer))
    if isinstance(answer, (list, tuple)):
        return ", ".join(normalize_reference(part) for part in answer)
    return str(answer).strip().strip("$").strip()


# ---------------------------------------------------------------------------------------------------------------------
# Time limit
# ---------------------------------------------------------------------------------------------------------------------
class _DeadlineExceeded(BaseException):
    """Raised inside a verification that ran past its time limit (a `BaseException`, so libraries don't swallow it)."""


_ALARM_REPEAT_SECONDS = 0.05


def _run_with_alarm(func: Callable[[], _T], seconds: float) -> _T:
    """Runs `func` in the main thread, interrupted by `SIGALRM` after `seconds`; restores any timer already set."""

    def on_alarm(signum, frame):
        raise _DeadlineExceeded()

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    # The timer repeats until disarmed, in case some library code swallows the first interruption.
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds, _ALARM_REPEAT_SECONDS)
    started = time.monotonic()
    try:
        return func()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler if previous_handler is not None else signal.SIG_DFL)
        if previous_delay > 0:
            remaining = max(previous_delay - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, previous_interval)


def _run_in_thread(func: Callable[[], _T], seconds: float) -> _T:
    """
    Runs `func` in a helper thread and waits at most `seconds`. On timeout the helper is stopped by an asynchronous
    exception (raised at its next Python instruction) and `_DeadlineExceeded` is raised here.
    """
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = func()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error

    helper = threading.Thread(target=target, name="trl_lopti-math-verify", daemon=True)
    helper.start()
    helper.join(seconds)
    if helper.is_alive():
        stopped = ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(helper.ident), ctypes.py_object(_DeadlineExceeded)
        )
        if stopped > 1:  # should not happen; undo rather than disturb other threads
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(helper.ident), None)
        raise _DeadlineExceeded()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


def run_with_time_limit(func: Callable[[], _T], seconds: float | None) -> _T:
    """
    Runs `func()` in this process, interrupting it after `seconds` of wall-clock time.

    In the main thread a `SIGALRM` timer interrupts it (any timer already set is restored afterwards). In other
    threads, where signals cannot be used, it runs in a helper thread that is stopped with an asynchronous exception;
    that cannot interrupt a long call into C code, which is why [`math_reward`] verifies in a worker process when it
    is called outside the main thread.

    Args:
        func (`Callable[[], T]`):
            The work.
        seconds (`float` or `None`):
            Time limit; `None` or `<= 0` for none.

    Returns:
        `T`: What `func` returned. Raises `_DeadlineExceeded` (a `BaseException`) on timeout.
    """
    if seconds is None or seconds <= 0:
        return func()
    if _in_main_thread():
        try:
            return _run_with_alarm(func, seconds)
        except ValueError as error:  # signals unavailable here (e.g. a sub-interpreter)
            if "signal" not in str(error):
                raise
    return _run_in_thread(func, seconds)


# ---------------------------------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------------------------------
class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its own (signal-based) timeouts are off: here the caller enforces the limit."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_log_filter_installed = False


def _import_math_verify():
    global _log_filter_installed
    try:
        import math_verify
    except ImportError as error:
        raise ImportError('math_reward needs math-verify: pip install "trl_lopti[math]"') from error
    if not _log_filter_installed:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _log_filter_installed = True
    return math_verify


_HUGE_EXPONENT_DIGITS = 7  # 3^{999999} is exact in well under a second; 3^{12345678} or 10^{10^{10}} are not
_HUGE_FACTORIAL_DIGITS = 6
_NUMBER_POWER = re.compile(r"\d\s*(?:\^|\*\*)")


def _exponent_groups(text: str) -> list[str]:
    """The exponents in `text`: what follows each `^` or `**` (a brace group, a parenthesised group or one token)."""
    groups = []
    index = 0
    while index < len(text):
        if text[index] == "^" or text.startswith("**", index):
            position = index + (1 if text[index] == "^" else 2)
            while position < len(text) and text[position] == " ":
                position += 1
            if position < len(text) and text[position] in "{(":
                opening, closing = text[position], "}" if text[position] == "{" else ")"
                depth, end = 0, position
                while end < len(text):
                    depth += (text[end] == opening) - (text[end] == closing)
                    if depth == 0:
                        break
                    end += 1
                groups.append(text[position : end + 1])
            else:
                end = position
                while end < len(text) and (text[end].isalnum() or text[end] in ".\\"):
                    end += 1
                groups.append(text[position:end])
            index = position
        else:
            index += 1
    return groups


def looks_explosive(answer: str) -> bool:
    """
    Whether a predicted answer could make sympy compute an astronomically large exact number: an exponent that holds
    a power of a number (`2^{2^{40}}`), a number of 7 or more digits (`3^{12345678}`) or a factorial (`2^{100!}`), or
    the factorial of a number of 6 or more digits. Such numbers are computed in C code, which a time limit cannot
    always interrupt (not outside the main thread, nor with sympy's gmpy2 backend). Symbolic towers (`e^{x^2}`) are
    fine.

    Such answers score 0 without being parsed: no competition answer needs them.

    Args:
        answer (`str`):
            The extracted answer.

    Returns:
        `bool`: `True` if the answer should not be evaluated.
    """
    huge_number = re.compile(rf"\d{{{_HUGE_EXPONENT_DIGITS},}}")
    for group in _exponent_groups(answer):
        if _NUMBER_POWER.search(group) or huge_number.search(group) or re.search(r"\d\s*!", group):
            return True
    return bool(re.search(rf"\d{{{_HUGE_FACTORIAL_DIGITS},}}\s*!", answer))


def _is_correct(response: str, reference: str, boxed_only: bool) -> bool:
    """Parses the prediction and the reference with math-verify (its own timeouts off) and compares them."""
    math_verify = _import_math_verify()
    final_part = _final_part(response)
    boxed = extract_boxed_answer(final_part)
    if boxed is not None:
        prediction_text = "\\boxed{" + boxed + "}"
    elif boxed_only:
        return False
    else:
        prediction_text = final_part[-MAX_FALLBACK_CHARS:]
    if not reference or len(reference) > MAX_ANSWER_CHARS:
        return False
    if (boxed is not None and len(boxed) > MAX_ANSWER_CHARS) or looks_explosive(prediction_text):
        return False
    reference_text = reference if "\\boxed" in reference else "\\boxed{" + reference + "}"
    gold = math_verify.parse(reference_text, parsing_timeout=None)
    if not gold:
        return False
    prediction = math_verify.parse(prediction_text, parsing_timeout=None)
    if not prediction:
        return False
    return bool(math_verify.verify(gold, prediction, timeout_seconds=None))


def _score_in_process(response: str, reference: str, boxed_only: bool, timeout_seconds: float | None) -> float:
    try:
        correct = run_with_time_limit(lambda: _is_correct(response, reference, boxed_only), timeout_seconds)
        return 1.0 if correct else 0.0
    except (Exception, _DeadlineExceeded):  # noqa: BLE001 - a bad answer scores 0
        return 0.0


# The worker runs this file as a standalone module (not through the `trl_lopti` package, whose import pulls TRL).
_WORKER_SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_trl_lopti_math_worker", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
module._serve_worker()
"""
_WORKER_STARTUP_SECONDS = 120.0
_WORKER_GRACE_SECONDS = 1.0


def _serve_worker() -> None:
    """Worker loop: one JSON request per line on stdin, one score per line on stdout, verified in the main thread."""
    _score_in_process("\\boxed{1}", "1", False, None)  # warm the parser up before taking requests
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        score = _score_in_process(
            request["response"], request["reference"], request["boxed_only"], request["timeout_seconds"]
        )
        sys.stdout.write(json.dumps(score) + "\n")
        sys.stdout.flush()


class _VerifierWorker:
    """
    A child Python process that verifies answers in its own main thread, where the `SIGALRM` time limit works; used
    when [`math_reward`] is called outside the main thread. If the child does not answer in time (stuck in C code) it
    is killed, the answer scores 0, and the next request starts a new child. Requests from several threads are
    served one at a time.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def _wait_for_line(self, seconds: float) -> str | None:
        ready, _, _ = select.select([self._process.stdout], [], [], seconds)
        return self._process.stdout.readline() if ready else None

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_SCRIPT, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self._wait_for_line(_WORKER_STARTUP_SECONDS) != "ready\n":
            self._stop()
            raise RuntimeError("The math-verify worker process did not start")

    def score(self, response: str, reference: str, boxed_only: bool, timeout_seconds: float | None) -> float:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            request = {
                "response": response,
                "reference": reference,
                "boxed_only": boxed_only,
                "timeout_seconds": timeout_seconds,
            }
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            wait = None if timeout_seconds is None or timeout_seconds <= 0 else timeout_seconds + _WORKER_GRACE_SECONDS
            reply = self._wait_for_line(wait)
            if not reply:  # too slow, or the child died
                self._stop()
                return 0.0
            return float(json.loads(reply))

    def close(self) -> None:
        with self._lock:
            self._stop()


_worker: _VerifierWorker | None = None
_worker_lock = threading.Lock()


def _get_worker() -> _VerifierWorker | None:
    global _worker
    if os.name != "posix":  # `select` on pipes is POSIX-only
        return None
    with _worker_lock:
        if _worker is None:
            _worker = _VerifierWorker()
            atexit.register(_worker.close)
        return _worker


def verify_answer(
    completion: Any, solution: Any, boxed_only: bool = False, timeout_seconds: float | None = 3.0
) -> float:
    """
    Scores one completion: 1.0 if its final answer equals the reference, else 0.0. Never raises.

    In the main thread the check runs in this process under a `SIGALRM` time limit. In any other thread it runs in a
    worker process (started on first use, restarted after a timeout), so that a stuck computation can be killed.

    Args:
        completion (`str` or `list[dict]`):
            The model's response (plain or conversational).
        solution (`Any`):
            The reference answer: a string (with or without `\\boxed{}`), a number, or a list of strings forming
            one answer (see [`normalize_reference`]).
        boxed_only (`bool`, *optional*, defaults to `False`):
            Score 0 when there is no `\\boxed{}` instead of falling back to math-verify's own extraction ("the final
            answer is ...", the last formula or number of the response).
        timeout_seconds (`float` or `None`, *optional*, defaults to `3.0`):
            Wall-clock limit for parsing and comparing; past it the completion scores 0.

    Returns:
        `float`: `1.0` or `0.0`.
    """
    _import_math_verify()  # the one error that escapes: math-verify is not installed
    try:
        response = completion_to_text(completion)
        reference = normalize_reference(solution)
        if not _in_main_thread():
            worker = _get_worker()
            if worker is not None:
                try:
                    return worker.score(response, reference, boxed_only, timeout_seconds)
                except (OSError, RuntimeError, ValueError):
                    pass  # no worker process here: check in this process
        return _score_in_process(response, reference, boxed_only, timeout_seconds)
    except Exception:  # noqa: BLE001 - a bad answer scores 0
        return 0.0


def math_reward(
    completions: Sequence[Any],
    solution: Sequence[Any],
    boxed_only: bool = False,
    timeout_seconds: float | None = 3.0,
    **kwargs: Any,
) -> list[float]:
    """
    TRL reward function: 1.0 for a completion whose final answer is mathematically equal to the reference, else 0.0.

    The answer is the content of the last `\\boxed{...}` after the last `</think>` (the whole response when there is
    no `</think>`); without a box, math-verify's own extraction ("final answer is ...", last formula, last number)
    is the fallback unless `boxed_only=True`. Equivalence is math-verify's (`parse` + `verify`): `\\frac{1}{2}`,
    `1/2` and `0.5` agree, as do equal intervals, sets (in any order), tuples and symbolic expressions.

    Malformed LaTeX and unreadable completions score 0; no exception escapes (except `ImportError` when math-verify
    is not installed). Each completion gets at most `timeout_seconds` of wall-clock time, in the main thread and in
    any other thread (see [`verify_answer`]); answers that would make sympy compute astronomically large exact
    numbers score 0 unparsed (see [`looks_explosive`]).

    Args:
        completions (`Sequence[str]` or `Sequence[list[dict]]`):
            Plain-text or conversational completions.
        solution (`Sequence[Any]`):
            Reference answer per completion (the dataset's `solution` column).
        boxed_only (`bool`, *optional*, defaults to `False`):
            Require a `\\boxed{}` answer (the paper's math reward gives 0 without one).
        timeout_seconds (`float` or `None`, *optional*, defaults to `3.0`):
            Time limit per completion.
        **kwargs:
            Other dataset columns and trainer arguments, ignored.

    Returns:
        `list[float]`: One score per completion.
    """
    return [
        verify_answer(completion, reference, boxed_only, timeout_seconds)
        for completion, reference in zip(completions, solution, strict=True)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------------
def make_math_prompt(
    problem: str, prompt_suffix: str = MATH_PROMPT_SUFFIX, system_prompt: str | None = None
) -> list[dict[str, str]]:
    """
    The conversational prompt of a problem, in the paper's style: the problem, then the instruction to reason step by
    step and box the final answer.

    Args:
        problem (`str`):
            The problem statement.
        prompt_suffix (`str`, *optional*, defaults to [`MATH_PROMPT_SUFFIX`]):
            Appended after a space.
        system_prompt (`str` or `None`, *optional*):
            An optional system message (the paper uses none).

    Returns:
        `list[dict[str, str]]`: The messages.
    """
    content = f"{problem.strip()} {prompt_suffix}".strip()
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": content}]


def math_record_to_example(
    record: dict[str, Any],
    problem_column: str,
    answer_column: str,
    prompt_suffix: str = MATH_PROMPT_SUFFIX,
    system_prompt: str | None = None,
) -> dict[str, Any]:
    """
    Maps one row of a math set to the TRL columns `prompt` (conversational) and `solution` (reference answer), keeping
    the raw `problem`.

    Args:
        record (`dict[str, Any]`):
            The row.
        problem_column (`str`):
            Column with the problem.
        answer_column (`str`):
            Column with the final answer.
        prompt_suffix (`str`, *optional*, defaults to [`MATH_PROMPT_SUFFIX`]):
            See [`make_math_prompt`].
        system_prompt (`str` or `None`, *optional*):
            See [`make_math_prompt`].

    Returns:
        `dict[str, Any]`: `{"prompt": ..., "problem": ..., "solution": ...}`.
    """
    problem = str(record[problem_column])
    return {
        "prompt": make_math_prompt(problem, prompt_suffix, system_prompt),
        "problem": problem,
        "solution": normalize_reference(record[answer_column]),
    }


def orz_pairs_to_records(pairs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """
    Flattens ORZ's `[{"from": "human", "value": question}, {"from": "assistant", "ground_truth": {"value": answer}}]`
    pairs into rows with columns `value` (the question) and `ground_truth` (the answer, as a string).

    Args:
        pairs (`Sequence[Sequence[dict]]`):
            The JSON content of the ORZ file.

    Returns:
        `list[dict[str, Any]]`: One row per pair.
    """
    records = []
    for question, answer in (pair[:2] for pair in pairs):
        records.append(
            {"value": question.get("value", ""), "ground_truth": normalize_reference(answer.get("ground_truth", ""))}
        )
    return records


def _load_raw(spec: MathDatasetSpec, data_files: str | Sequence[str] | None, **load_dataset_kwargs: Any):
    import datasets

    if spec.data_file is not None:  # a single JSON file of message pairs (ORZ)
        paths = [data_files] if isinstance(data_files, str) else list(data_files or [])
        if not paths:
            from huggingface_hub import hf_hub_download

            paths = [hf_hub_download(spec.path, spec.data_file, repo_type="dataset")]
        records = []
        for path in paths:
            with open(path, encoding="utf-8") as file:
                records.extend(orz_pairs_to_records(json.load(file)))
        return datasets.Dataset.from_list(records)
    if data_files is not None:  # local files with the Hub set's columns
        first = data_files if isinstance(data_files, str) else next(iter(data_files))
        builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}[first.rsplit(".", 1)[-1]]
        return datasets.load_dataset(builder, data_files=data_files, split="train", **load_dataset_kwargs)
    return datasets.load_dataset(spec.path, spec.name, split=spec.split, **load_dataset_kwargs)


def load_math_dataset(
    name: str | MathDatasetSpec,
    data_files: str | Sequence[str] | None = None,
    prompt_suffix: str = MATH_PROMPT_SUFFIX,
    system_prompt: str | None = None,
    **load_dataset_kwargs: Any,
):
    """
    Loads one of the paper's math sets, mapped to `prompt` (conversational, the paper's prompt style), `problem` and
    `solution` (the reference answer as a string, for [`math_reward`]). Other columns are dropped (DeepScaleR's
    worked `solution` included: here `solution` is the final answer).

    Args:
        name (`str` or [`MathDatasetSpec`]):
            A key of [`MATH_DATASETS`] (`"deepscaler"`, `"orz"`, `"math500"`, `"aime"`, `"aime24"`, `"amc"`,
            `"minerva"`, `"olympiadbench"`) or a spec of your own.
        data_files (`str` or `Sequence[str]`, *optional*):
            Local `.json`/`.jsonl`/`.parquet`/`.csv` files with the same columns as the Hub set, read instead of the
            Hub (for ORZ: its JSON file of message pairs).
        prompt_suffix (`str`, *optional*, defaults to [`MATH_PROMPT_SUFFIX`]):
            Instruction appended to each problem.
        system_prompt (`str` or `None`, *optional*):
            Optional system message.
        **load_dataset_kwargs:
            Passed to `datasets.load_dataset` (e.g. `revision`, `cache_dir`).

    Returns:
        `datasets.Dataset`: Columns `prompt`, `problem`, `solution`.
    """
    if isinstance(name, MathDatasetSpec):
        spec = name
    elif name in MATH_DATASETS:
        spec = MATH_DATASETS[name]
    else:
        raise ValueError(f"Unknown math dataset {name!r}; choose one of {sorted(MATH_DATASETS)} or pass a spec")
    raw = _load_raw(spec, data_files, **load_dataset_kwargs)
    if spec.year_column is not None and spec.years is not None:
        first_year, last_year = spec.years
        raw = raw.filter(lambda year: first_year <= int(year) <= last_year, input_columns=spec.year_column)
    return raw.map(
        math_record_to_example,
        fn_kwargs={
            "problem_column": spec.problem_column,
            "answer_column": spec.answer_column,
            "prompt_suffix": prompt_suffix,
            "system_prompt": system_prompt,
        },
        remove_columns=raw.column_names,
    ).select_columns(["prompt", "problem", "solution"])
