"""Completion text extraction for the tasks' reward functions, and a reward that varies on any model."""

from typing import Any


def completion_to_text(completion: Any) -> str:
    """The text of a completion, whether TRL passes it as a string or as conversational messages.

    Messages (a list of them, or one) whose `content` is a string or a list of parts are joined with
    newlines; an unreadable completion gives `""`."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)):
        return "\n".join(completion_to_text(message) for message in completion)
    content = completion.get("content", "") if isinstance(completion, dict) else ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def token_parity_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """TRL reward function: the share of even token ids in a completion (0 for an empty one).

    It varies between the completions of a group on any model, a random one included, so that advantages are
    not all zero where a task's reward is never earned (rehearsals, benchmarks, tests on random models)."""
    return [sum(token % 2 == 0 for token in ids) / max(len(ids), 1) for ids in completion_ids]
