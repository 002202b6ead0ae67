"""Grading of math answers for TRL: the paper's grading (`math_reward`) and a lenient variant (`math_reward_lenient`).

[`math_reward`] gives the authors' reward (their verl fork, DeepScaleR's `RewardMathFn`): 1 when the last
`\\boxed{...}` in the text between the first and second `</think>` (the whole response without one) equals a reference
under their string normaliser or their sympy check, else 0 (rules in [`~trl_lopti.tasks.math.paper_grading`]).
[`math_reward_lenient`] grades the text after the LAST `</think>` with math-verify (`parse` + `verify`), reads
`\\boxed 5`, `\\fbox{}` and, without a box, math-verify's own extraction ("the final answer is ...", the last formula
or number); it is not the paper's grader.

Both run under a wall-clock limit; nothing raises. Optional dependencies: `pip install "trl_lopti[math]"`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from .._text import completion_to_text
from .._time_limit import DeadlineExceeded, in_main_thread, run_with_time_limit, shared_worker
from .paper_grading import paper_is_correct, reference_answers


GRADING_MODES = ("paper", "lenient")
"""`"paper"`: `\\boxed{}` required, text after the first `</think>`. `"lenient"`: text after the last `</think>`,
unboxed fallback."""

MAX_ANSWER_CHARS = 1_000
"""Longer extracted answers score 0 without being parsed (a guard against pathological inputs)."""

MAX_FALLBACK_CHARS = 2_000
"""Without a `\\boxed{}`, only this many final characters of the response are searched for an answer."""

_BOX_COMMANDS = ("\\boxed", "\\fbox")


# ---------------------------------------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------------------------------------
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


def final_part(text: str, mode: str = "paper") -> str:
    """
    The part of a response that is graded: the answer section after the thinking.

    Args:
        text (`str`):
            The response.
        mode (`str`, *optional*, defaults to `"paper"`):
            `"paper"`: the text between the first `</think>` and the next one (the authors split on `</think>` and
            take item 1); `"lenient"`: the text after the last `</think>`. Without `</think>`: the whole text.

    Returns:
        `str`: The graded part.
    """
    marker = "</think>"
    if marker not in text:
        return text
    return text.split(marker)[1] if mode == "paper" else text.rsplit(marker, 1)[1]


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
# Verification
# ---------------------------------------------------------------------------------------------------------------------
class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its own (signal-based) timeouts are off: here the caller enforces the limit."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_log_filter_installed = False


def _import_grader(mode: str) -> None:
    """The paper mode needs sympy and pylatexenc, the lenient mode math-verify (all in the `math` extra)."""
    if mode != "paper":
        _import_math_verify()
        return
    try:
        import pylatexenc  # noqa: F401
        import sympy  # noqa: F401
    except ImportError as error:
        raise ImportError('math_reward needs sympy and pylatexenc: pip install "trl_lopti[math]"') from error


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


def _paper_sympy_allowed(answer: str) -> bool:
    return len(answer) <= MAX_ANSWER_CHARS and not looks_explosive(answer)


def _is_correct(response: str, reference: Any, mode: str) -> bool:
    """The paper mode: the authors' rules ([`paper_is_correct`]). The lenient mode: math-verify (its own timeouts off)
    parses and compares the prediction and the reference."""
    if mode == "paper":
        return paper_is_correct(response, reference, allow_sympy=_paper_sympy_allowed)
    math_verify = _import_math_verify()
    reference = normalize_reference(reference)
    graded = final_part(response, mode)
    boxed = extract_boxed_answer(graded)
    if boxed is not None:
        prediction_text = "\\boxed{" + boxed + "}"
    else:
        prediction_text = graded[-MAX_FALLBACK_CHARS:]
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


def score_in_process(response: str, reference: Any, mode: str, timeout_seconds: float | None) -> float:
    """
    Scores a response in this process under [`run_with_time_limit`]: `1.0` or `0.0`, never raises. The function a
    worker process serves (its arguments and result are JSON).
    """
    try:
        correct = run_with_time_limit(lambda: _is_correct(response, reference, mode), timeout_seconds)
        return 1.0 if correct else 0.0
    except (Exception, DeadlineExceeded):  # noqa: BLE001 - a bad answer scores 0
        return 0.0


WORKER_TARGET = f"{__name__}:score_in_process"
"""What a worker process serves when [`verify_answer`] is called outside the main thread."""


def verify_answer(
    completion: Any, solution: Any, mode: str = "paper", timeout_seconds: float | None = 3.0
) -> float:
    """
    Scores one completion: 1.0 if its final answer equals the reference, else 0.0. Never raises.

    In the main thread the check runs in this process under a `SIGALRM` time limit. In any other thread it runs in a
    worker process (started on first use, killed and restarted after a timeout), so that a stuck computation in C
    code cannot hang the caller.

    Args:
        completion (`str` or `list[dict]`):
            The model's response (plain or conversational).
        solution (`Any`):
            The reference answer: a string (with or without `\\boxed{}`) or a number. A list is one answer in the
            lenient mode (see [`normalize_reference`]) and alternatives in the paper mode (any one counts, as the
            authors' grader reads a list; see [`reference_answers`]).
        mode (`str`, *optional*, defaults to `"paper"`):
            One of [`GRADING_MODES`]; see [`final_part`]. `"paper"` scores 0 without a `\\boxed{}` answer.
        timeout_seconds (`float` or `None`, *optional*, defaults to `3.0`):
            Wall-clock limit for parsing and comparing; past it the completion scores 0.

    Returns:
        `float`: `1.0` or `0.0`.
    """
    if mode not in GRADING_MODES:
        raise ValueError(f"mode must be one of {list(GRADING_MODES)}, got {mode!r}")
    _import_grader(mode)  # the one error that escapes: the grader's library is not installed
    try:
        response = completion_to_text(completion)
        reference = reference_answers(solution) if mode == "paper" else normalize_reference(solution)
        if not in_main_thread():
            worker = shared_worker(WORKER_TARGET, warmup_args=("\\boxed{1}", "1", "paper", None))
            if worker is not None:
                try:
                    return float(worker.call((response, reference, mode, timeout_seconds), timeout_seconds) or 0.0)
                except (OSError, RuntimeError, ValueError):
                    pass  # no worker process here: check in this process
        return score_in_process(response, reference, mode, timeout_seconds)
    except Exception:  # noqa: BLE001 - a bad answer scores 0
        return 0.0


def _math_rewards(completions: Sequence[Any], solution: Sequence[Any], mode: str, timeout_seconds: float | None):
    return [
        verify_answer(completion, reference, mode, timeout_seconds)
        for completion, reference in zip(completions, solution, strict=True)
    ]


def math_reward(
    completions: Sequence[Any], solution: Sequence[Any], timeout_seconds: float | None = 3.0, **kwargs: Any
) -> list[float]:
    """
    TRL reward function, the paper's math grading: the authors' reward, 1.0 or 0.0.

    The answer is the content of the last `\\boxed{...}` (balanced braces) in the text between the first and second
    `</think>` (the whole response when there is none); no such box scores 0 (`\\fbox`, `\\boxed 7` and an unclosed
    last box do not count). It is correct when it equals a reference under the authors' rules
    ([`~trl_lopti.tasks.math.paper_grading`]): the MATH string normaliser, or their sympy check. As theirs, it does
    not accept an unreduced fraction for a reduced one (`\\frac{2}{4}` vs `\\frac{1}{2}`), a non-integer form of an
    integer (`1.5\\times10^3` vs `1500`), or sets and lists in another order. For math-verify's equivalence and
    unboxed answers use [`math_reward_lenient`].

    Malformed LaTeX and unreadable completions score 0; no exception escapes (except `ImportError` when sympy or
    pylatexenc is not installed). Each completion gets at most `timeout_seconds` of wall-clock time, in the main
    thread and in any other thread (see [`verify_answer`]), and answers that would make sympy compute astronomically
    large exact numbers get the string check only (see [`looks_explosive`]): the authors' grader has no limit.

    Args:
        completions (`Sequence[str]` or `Sequence[list[dict]]`):
            Plain-text or conversational completions.
        solution (`Sequence[Any]`):
            Reference answer per completion (the dataset's `solution` column).
        timeout_seconds (`float` or `None`, *optional*, defaults to `3.0`):
            Time limit per completion.
        **kwargs:
            Other dataset columns and trainer arguments, ignored.

    Returns:
        `list[float]`: One score per completion.
    """
    if "boxed_only" in kwargs:  # the former switch: a silent no-op here would change the grading unnoticed
        raise TypeError(
            "boxed_only: math_reward always requires a \\boxed{} answer (the paper's grading); use "
            "math_reward_lenient for the unboxed fallback"
        )
    return _math_rewards(completions, solution, "paper", timeout_seconds)


def math_reward_lenient(
    completions: Sequence[Any], solution: Sequence[Any], timeout_seconds: float | None = 3.0, **kwargs: Any
) -> list[float]:
    """
    TRL reward function, lenient math grading: like [`math_reward`], but the text after the LAST `</think>` is graded
    and, without a `\\boxed{}`, math-verify's own extraction ("the final answer is ...", the last formula or number)
    is the fallback. Not the paper's grader; useful for models that do not box their answers. Arguments and return
    value: as [`math_reward`].
    """
    return _math_rewards(completions, solution, "lenient", timeout_seconds)
