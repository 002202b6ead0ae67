"""TRL reward functions for math answers. Dependencies: `pip install "trl_lopti[math]"`.

- [`math_reward`]: the paper's grading, the authors' reward (their verl fork's and DeepScaleR's
  `RewardMathFn`), under a wall-clock limit per completion.
- [`math_reward_lenient`]: TRL's own (math-verify), not the paper's grader.
"""

import contextlib
import math
import re
from collections.abc import Sequence
from typing import Any

from .._text import completion_to_text
from .._time_limit import DeadlineExceeded, in_main_thread, run_with_time_limit, shared_worker
from .paper_grading import paper_is_correct, reference_answers


MAX_ANSWER_CHARS = 1_000
"""Longer answers get the string check only (no sympy): a guard against pathological inputs."""


def normalize_reference(answer: Any) -> str:
    """A reference answer as a string for [`math_reward`].

    The answer is a string, a number such as `142.0` (written without a spurious `.0`) or a list of strings
    such as `["$3$", "$5$"]` (joined with ", "); `$` and spaces are removed at the ends."""
    if isinstance(answer, dict) and "value" in answer:  # ORZ's {"value": ..., "pass_at_n": ...}
        answer = answer["value"]
    if isinstance(answer, float) and math.isfinite(answer) and answer.is_integer():
        return str(int(answer))
    if isinstance(answer, (list, tuple)):
        return ", ".join(normalize_reference(part) for part in answer)
    return str(answer).strip().strip("$").strip()


# 3^{999999} is exact in well under a second; 3^{12345678} or 10^{10^{10}} are not.
_HUGE_EXPONENT_DIGITS = 7
_HUGE_FACTORIAL_DIGITS = 6
_NUMBER_POWER = re.compile(r"\d\s*(?:\^|\*\*)")
_POWER_OPERATOR = re.compile(r"(?:\^|\*\*) *")  # and the spaces after it
_TOKEN = re.compile(r"(?:[^\W_]|[.\\])*")  # letters and digits (`str.isalnum`), dots and backslashes


def _exponent_groups(text: str) -> list[str]:
    """What follows each `^` or `**` in `text`: a brace group, a parenthesised group or one token."""
    groups = []
    for operator in _POWER_OPERATOR.finditer(text):
        position = operator.end()
        if text[position : position + 1] not in ("{", "("):
            groups.append(_TOKEN.match(text, position).group())
            continue
        opening = text[position]
        closing = "}" if opening == "{" else ")"
        depth = 0
        # Up to the bracket that closes the group, or to the end.
        for end in range(position, len(text)):
            depth += (text[end] == opening) - (text[end] == closing)
            if depth == 0:
                break
        groups.append(text[position : end + 1])
    return groups


def looks_explosive(answer: str) -> bool:
    """Whether a predicted answer could make sympy compute an astronomically large exact number.

    That is an exponent that holds a power of a number (`2^{2^{40}}`), a number of 7 or more digits
    (`3^{12345678}`) or a factorial (`2^{100!}`), or the factorial of a number of 6 or more digits. Such
    numbers are computed in C code, which a time limit cannot always interrupt (not outside the main thread,
    nor with sympy's gmpy2 backend). Such answers get the string check only, no sympy: no competition answer
    needs them. Symbolic towers (`e^{x^2}`) are fine."""
    huge_number = re.compile(rf"\d{{{_HUGE_EXPONENT_DIGITS},}}")
    for group in _exponent_groups(answer):
        if _NUMBER_POWER.search(group) or huge_number.search(group) or re.search(r"\d\s*!", group):
            return True
    return bool(re.search(rf"\d{{{_HUGE_FACTORIAL_DIGITS},}}\s*!", answer))


def _sympy_allowed(answer: str) -> bool:
    return len(answer) <= MAX_ANSWER_CHARS and not looks_explosive(answer)


def score_in_process(response: str, reference: list[str], timeout_seconds: float | None) -> float:
    """Scores a response by the paper's rules in this process under [`run_with_time_limit`]: `1.0` or `0.0`.

    It never raises. It is the function a worker process serves (its arguments and result are JSON)."""
    try:
        grade = run_with_time_limit(lambda: paper_is_correct(response, reference, _sympy_allowed), timeout_seconds)
        return 1.0 if grade else 0.0
    except (Exception, DeadlineExceeded):  # noqa: BLE001 - a bad answer scores 0
        return 0.0


WORKER_TARGET = f"{__name__}:score_in_process"
"""What a worker process serves when [`math_reward`] is called outside the main thread."""


def _score(completion: Any, solution: Any, timeout_seconds: float | None) -> float:
    try:
        response = completion_to_text(completion)
        reference = reference_answers(solution)
        # Outside the main thread, grade in a worker process, whose main thread can interrupt sympy and which
        # is killed when stuck. Without a worker process, grade in this one.
        if not in_main_thread():
            worker = shared_worker(WORKER_TARGET, warmup_args=("\\boxed{1}", ["1"], None))
            if worker is not None:
                with contextlib.suppress(OSError, RuntimeError, ValueError):
                    return float(worker.call((response, reference, timeout_seconds), timeout_seconds) or 0.0)
        return score_in_process(response, reference, timeout_seconds)
    except Exception:  # noqa: BLE001 - a bad answer scores 0
        return 0.0


def math_reward(
    completions: Sequence[Any], solution: Sequence[Any], timeout_seconds: float | None = 3.0, **kwargs: Any
) -> list[float]:
    """TRL reward function, the paper's math grading: the authors' reward, 1.0 or 0.0.

    The answer is the content of the last `\\boxed{...}` (balanced braces) in the text between the first and
    second `</think>` (the whole response when there is none). No such box scores 0: `\\fbox`, `\\boxed 7`
    and an unclosed last box do not count. It is correct when it equals a reference under the authors' rules
    ([`~trl_lopti.tasks.math.paper_grading`]): the MATH string normaliser, or their sympy check. As theirs,
    it does not accept an unreduced fraction for a reduced one (`\\frac{2}{4}` vs `\\frac{1}{2}`), a
    non-integer form of an integer (`1.5\\times10^3` vs `1500`), or sets and lists in another order.

    Each completion gets at most `timeout_seconds` of wall-clock time, in the main thread (a `SIGALRM` timer)
    and in any other thread (a worker process, killed and restarted when stuck in C code). Answers that would
    make sympy compute astronomically large exact numbers get the string check only ([`looks_explosive`]).
    The authors' grader has no such limits. Malformed LaTeX and unreadable completions score 0; only
    `ImportError` escapes (sympy or pylatexenc not installed).

    Args:
        completions (`Sequence[str]` or `Sequence[list[dict]]`):
            Plain-text or conversational completions.
        solution (`Sequence[Any]`):
            The reference answer of each completion (the dataset's `solution` column): a string (with or
            without `\\boxed{}`), a number, or a list of alternatives (any one counts).
        timeout_seconds (`float` or `None`, *optional*, defaults to `3.0`):
            Time limit per completion.
        **kwargs:
            Other dataset columns and trainer arguments, ignored.
    """
    # The one error that escapes: the grader's libraries are not installed.
    import pylatexenc  # noqa: F401
    import sympy  # noqa: F401

    return [_score(c, s, timeout_seconds) for c, s in zip(completions, solution, strict=True)]


def math_reward_lenient(completions: Sequence[Any], solution: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """TRL reward function: TRL's `trl.rewards.accuracy_reward` on the text after the last `</think>`.

    Math-verify accepts equivalent forms and unboxed answers. This is an adapter, because TRL's reward takes
    conversational completions only and parses a reference as it stands (a bare `x^2+1` or `\\frac12` does
    not parse): here completions may be text, and each reference is [`normalize_reference`]d and boxed. It
    gives `None` (TRL: skip the completion) where math-verify cannot parse the reference. It is not the
    paper's grader; its time limits are math-verify's (in the main thread only)."""
    from trl.rewards import accuracy_reward

    texts = [completion_to_text(completion).rsplit("</think>", 1)[-1] for completion in completions]
    references = [normalize_reference(reference) for reference in solution]
    references = [ref if "\\boxed" in ref else "\\boxed{" + ref + "}" for ref in references]
    return accuracy_reward([[{"role": "assistant", "content": text}] for text in texts], references, **kwargs)
