"""A GRPO generation batch to measure, made by the trainer itself (TRL's generation, rewards and advantages)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..tasks._text import completion_to_text


def sample_generation_batch(trainer: Any, rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """
    Generates, scores and computes the advantages of one generation batch exactly as the trainer does in training.

    Every row is repeated `num_generations` times, consecutively, as TRL's `RepeatSampler` does, and handed to the
    trainer's `_generate_and_score_completions` in training mode (the training group and batch sizes). With a
    `LoptiGRPOTrainer` the batch is the one its passes would train on.

    Args:
        trainer (`trl.GRPOTrainer`):
            The trainer (a `LoptiGRPOTrainer` or TRL's own).
        rows (`Sequence[dict[str, Any]]`):
            The prompts, as dataset rows (a `prompt` and the columns the rewards read).

    Returns:
        `tuple[dict[str, Any], dict[str, Any]]`: The trainer's `inputs` dict (what `compute_loss` receives) and a
        summary (rewards, lengths, zero-advantage completions, three sample texts).
    """
    repeated = [dict(row) for row in rows for _ in range(trainer.num_generations)]
    model = trainer.model
    was_training = model.training
    model.train()
    try:
        inputs = trainer._generate_and_score_completions(repeated)
    finally:
        model.train(was_training)
    per_function = torch.tensor([list(values) for values in trainer._logs["rewards"].values()], dtype=torch.float32)
    rewards = torch.nan_to_num(per_function[:, -len(repeated) :], nan=0.0).sum(0)
    completion_mask, advantages = inputs["completion_mask"], inputs["advantages"]
    texts = [completion_to_text(completion) for completion in list(trainer._logs["completion"])[-len(repeated) :]]
    summary = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rewards": rewards.tolist(),
        "completion_length_mean": float(completion_mask.sum(1).float().mean()),
        "prompt_length_max": int(inputs["prompt_mask"].sum(1).max()),
        "num_completions": int(inputs["completion_ids"].size(0)),
        "num_zero_advantage_completions": int((advantages == 0).sum()),
        "sample_completions": texts[:3],
    }
    return inputs, summary
