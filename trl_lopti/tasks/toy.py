"""A toy task any causal LM can be measured on: short open prompts and rewards that vary on any model.

Used by `trl-lopti diagnose --task toy` (and `--reward`): the rewards are not a task to learn but a way to get GRPO
advantages that differ within a group, so that per-token gradients can be measured on small or random models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._text import completion_to_text


TOY_PROMPTS = (
    "Write one short sentence about the sea.",
    "Name three colours.",
    "Count from one to five.",
    "Say hello in a friendly way.",
    "Describe a cat in a few words.",
    "What is two plus two?",
    "List some fruits.",
    "Give me a word that rhymes with cat.",
)
"""The prompts of the toy task, used in turn."""


def toy_rows(num_prompts: int) -> list[dict[str, Any]]:
    """
    `num_prompts` conversational dataset rows, cycling through `TOY_PROMPTS`.

    Args:
        num_prompts (`int`):
            Rows.

    Returns:
        `list[dict[str, Any]]`: Rows with a `prompt` (one user message).
    """
    return [{"prompt": [{"role": "user", "content": TOY_PROMPTS[i % len(TOY_PROMPTS)]}]} for i in range(num_prompts)]


def letter_share_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """The share of letters among the completion's characters (0 for an empty one): varies on any model."""
    texts = [completion_to_text(completion) for completion in completions]
    return [sum(char.isalpha() for char in text) / max(1, len(text)) for text in texts]


def constant_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """Reward 1.0 for every completion: all advantages are zero."""
    return [1.0 for _ in completions]


def length_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """The completion's length in characters."""
    return [float(len(completion_to_text(completion))) for completion in completions]
