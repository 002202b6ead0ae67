"""Partial credit on Knights & Knaves, for models too weak for the paper's all-or-nothing reward (diagnostics only)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .._text import completion_to_text
from .rewards import knights_knaves_reward, parse_solution_text_format


def knights_knaves_partial_credit_reward(
    completions: Sequence[Any], solution_text_format: Sequence[str], **kwargs: Any
) -> list[float]:
    """
    The paper's reward plus, per person, +1/n when the response's last statement about them ("<name> is a <role>")
    gives the right role and -1/n when it gives the wrong one.

    Not the paper's reward: it gives rewards that differ within a group of a small model, so that `trl-lopti diagnose`
    has non-zero advantages to measure.

    Args:
        completions (`Sequence[str]` or `Sequence[list[dict]]`):
            Completions.
        solution_text_format (`Sequence[str]`):
            The solutions (dataset column).
        **kwargs:
            Passed to [`knights_knaves_reward`].

    Returns:
        `list[float]`: One reward per completion.
    """
    base = knights_knaves_reward(completions, solution_text_format, **kwargs)
    rewards = []
    for reward, completion, truth in zip(base, completions, solution_text_format, strict=True):
        text = completion_to_text(completion)
        roles = parse_solution_text_format(truth)
        bonus = 0.0
        for name, role in roles.items():
            said = re.findall(rf"\b{re.escape(name)}\b\s+is\s+a\s+(knight|knave)\b", text, re.IGNORECASE)
            if said:
                bonus += (1.0 if said[-1].lower() == role else -1.0) / len(roles)
        rewards.append(reward + bonus)
    return rewards
