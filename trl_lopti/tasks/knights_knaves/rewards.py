"""The paper's K&K reward (Logic-RL's `compute_score`) as TRL reward functions. Scoring:

- format: `+1` if the response holds exactly one `<think>`, `</think>`, `<answer>` and `</answer>`, in that
  order; `-1` otherwise.
- answer: `+2` if every person's identity in the `<answer>` block is right; `-1.5` if it parses but is wrong;
  `-2` if it cannot be parsed (a person is missing, or the number of "knight"/"knave" words differs from the
  number of people) or if the format failed.

So a completion scores 3, -0.5, -1 or -3. With the paper's prompt the `<think>` is pre-filled in the prompt,
and the reward functions count it as the response's first tag (the dataset's `think_prefilled` column says
so).

As the authors' scorer, which splits the decoded prompt + response at the first literal `Assistant:` (the
paper's prompt has none), a completion containing `Assistant:` is scored on the text after its first
`Assistant:` only, without the pre-filled `<think>` ([`scored_response`]).
"""

import re
from collections.abc import Callable, Sequence
from typing import Any

from .._text import completion_to_text


THINK_PREFILL = "<think>"
"""Text the prompt puts at the start of the assistant turn when `<think>` is pre-filled."""

ASSISTANT_MARKER = "Assistant:"
"""The authors' scorer scores what follows this text's first occurrence in the decoded prompt + response."""

FORMAT_REWARD = 1.0
ANSWER_CORRECT_REWARD = 2.0
ANSWER_WRONG_REWARD = -1.5
ANSWER_UNPARSABLE_REWARD = -2.0

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SOLUTION_LINE = re.compile(r"^\s*(?:\(\d+\)\s*)?([A-Za-z][\w'-]*)\b.*?\b(knight|knave)\b", re.IGNORECASE)


def has_valid_format(response: str) -> bool:
    """Whether `response` (with a pre-filled `<think>`) holds exactly one `<think>`, `</think>`, `<answer>`
    and `</answer>`, in that order: the format check of the paper's reward."""
    if any(response.count(tag) != 1 for tag in _TAGS):
        return False
    positions = [response.find(tag) for tag in _TAGS]
    return positions == sorted(positions)


def extract_answer(response: str) -> str | None:
    """The stripped content of the last `<answer> ... </answer>` block, `None` without one."""
    blocks = _ANSWER_BLOCK.findall(response)
    return blocks[-1].strip() if blocks else None


def parse_solution_text_format(solution_text_format: str) -> dict[str, str]:
    """Name -> `"knight"` or `"knave"`, in line order, from a ground truth with one person a line, name
    first, role last (`"(1) Zoey is a knight\\n(2) Oliver is a knave"`)."""
    matches = (_SOLUTION_LINE.search(line) for line in solution_text_format.splitlines())
    return {match.group(1): match.group(2).lower() for match in matches if match}


def parse_answer_roles(answer: str, names: Sequence[str]) -> dict[str, str] | None:
    """Name -> `"knight"`/`"knave"` for each of `names`, read from an `<answer>` block as the paper reads it.

    `None` (unparsable) when the words "knight" and "knave" (case-insensitive, also inside longer words)
    occur in total a different number of times than there are people, or when some name is not followed by
    "is a knight" / "is a knave" (whole-word, case-insensitive; the first such phrase per name counts)."""
    lowered = answer.lower()
    if lowered.count("knight") + lowered.count("knave") != len(names):
        return None
    roles = {}
    for name in names:
        match = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer, re.IGNORECASE)
        if match is None:
            return None
        roles[name] = match.group(1).lower()
    return roles


def score_format(response: str) -> float:
    """Format part of the paper's reward: `1.0` if [`has_valid_format`], else `-1.0`."""
    return FORMAT_REWARD if has_valid_format(response) else -FORMAT_REWARD


def score_answer(response: str, solution_text_format: str) -> float:
    """Answer part of the paper's reward: `response` (with a pre-filled `<think>`) against the ground truth.

    `2.0` when all identities are right, `-1.5` parsed but wrong, `-2.0` unparsable, empty or format failed.
    The ground truth is read by [`parse_solution_text_format`]."""
    answer = extract_answer(response) if has_valid_format(response) else None
    if not answer:
        return ANSWER_UNPARSABLE_REWARD
    expected = parse_solution_text_format(solution_text_format)
    predicted = parse_answer_roles(answer, list(expected))
    if predicted is None:
        return ANSWER_UNPARSABLE_REWARD
    return ANSWER_CORRECT_REWARD if predicted == expected else ANSWER_WRONG_REWARD


def scored_response(completion: str, think_prefilled: bool) -> str:
    """The text the paper's reward scores for one completion (as TRL passes it, without the prompt).

    That is the completion after its first `Assistant:` if it holds one (the authors' split), else the
    pre-filled `<think>` (when the prompt has it) followed by the completion."""
    if ASSISTANT_MARKER in completion:
        return completion.split(ASSISTANT_MARKER, 1)[1]
    return (THINK_PREFILL if think_prefilled else "") + completion


def _responses(completions: Sequence[Any], think_prefilled: bool | Sequence[bool] | None) -> list[str]:
    if isinstance(think_prefilled, (list, tuple)):
        if len(think_prefilled) != len(completions):
            raise ValueError(f"think_prefilled has {len(think_prefilled)} values for {len(completions)} completions")
    else:
        think_prefilled = [think_prefilled] * len(completions)
    return [scored_response(completion_to_text(c), bool(p)) for c, p in zip(completions, think_prefilled, strict=True)]


def knights_knaves_format_reward(
    completions: Sequence[Any], think_prefilled: bool | Sequence[bool] | None = False, **kwargs: Any
) -> list[float]:
    """TRL reward function: the format part of the paper's K&K reward (`+1` / `-1`).

    The arguments are those of [`knights_knaves_reward`]. With
    `reward_funcs=[knights_knaves_format_reward, knights_knaves_answer_reward]` (default weights 1) TRL
    trains on exactly [`knights_knaves_reward`] while it logs both parts
    (`rewards/knights_knaves_format_reward/mean`, `rewards/knights_knaves_answer_reward/mean`)."""
    return [score_format(response) for response in _responses(completions, think_prefilled)]


def knights_knaves_answer_reward(
    completions: Sequence[Any],
    solution_text_format: Sequence[str],
    think_prefilled: bool | Sequence[bool] | None = False,
    **kwargs: Any,
) -> list[float]:
    """TRL reward function: the answer part of the paper's K&K reward (`+2` / `-1.5` / `-2`).

    A failed format scores `-2`. The arguments are those of [`knights_knaves_reward`]."""
    responses = _responses(completions, think_prefilled)
    return [score_answer(response, truth) for response, truth in zip(responses, solution_text_format, strict=True)]


def knights_knaves_reward(
    completions: Sequence[Any],
    solution_text_format: Sequence[str],
    think_prefilled: bool | Sequence[bool] | None = False,
    log_metric: Callable[[str, float], None] | None = None,
    **kwargs: Any,
) -> list[float]:
    """TRL reward function: the paper's K&K reward, format plus answer (3, -0.5, -1 or -3 per completion).

    Equals `knights_knaves_format_reward + knights_knaves_answer_reward` exactly. Inside TRL's `GRPOTrainer`
    it also logs its parts through TRL's `log_metric` hook: `knights_knaves/format` and
    `knights_knaves/answer` (batch means) and `knights_knaves/accuracy` (the share of completions with every
    identity right).

    Args:
        completions (`Sequence[str]` or `Sequence[list[dict]]`):
            Plain-text or conversational completions.
        solution_text_format (`Sequence[str]`):
            The ground truth of each completion (the dataset column), e.g.
            `"(1) Zoey is a knight\\n(2) Oliver is a knave"`.
        think_prefilled (`bool` or `Sequence[bool]`, *optional*, defaults to `False`):
            Whether the prompt ends with a pre-filled `<think>` that the completion continues; it is then
            counted as the response's first tag. TRL passes the dataset's `think_prefilled` column (one value
            per completion), which [`generate_dataset`] and [`load_knights_knaves_dataset`] write; for other
            datasets set it with `functools.partial(knights_knaves_reward, think_prefilled=True)`.
        log_metric (`Callable[[str, float], None]`, *optional*):
            Passed by TRL; receives the sub-scores.
        **kwargs:
            Other dataset columns and trainer arguments, ignored.
    """
    format_scores = knights_knaves_format_reward(completions, think_prefilled=think_prefilled)
    answer_scores = knights_knaves_answer_reward(completions, solution_text_format, think_prefilled=think_prefilled)
    if callable(log_metric) and completions:
        count = len(completions)
        log_metric("knights_knaves/format", sum(format_scores) / count)
        log_metric("knights_knaves/answer", sum(answer_scores) / count)
        log_metric("knights_knaves/accuracy", sum(s == ANSWER_CORRECT_REWARD for s in answer_scores) / count)
    scores = zip(format_scores, answer_scores, strict=True)
    return [format_score + answer_score for format_score, answer_score in scores]
