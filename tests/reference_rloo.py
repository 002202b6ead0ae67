"""An independent implementation of TRL's RLOO (advantages and loss), written from the formulas, to check the trainer.

Nothing here imports trl or trl_lopti: the trainer's numbers must match numbers computed another way. The loss's
gradient is derived by hand (not by autograd through the clipping), so that a token's gradient weight can be set
directly: AR's weight, Lopti's active mask, or both.
"""

from __future__ import annotations

import torch


def rloo_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    normalize: bool = False,
) -> torch.Tensor:
    """
    RLOO's advantages of a generation batch (every completion scorable): each completion's reward minus `beta` times
    its summed KL, minus the mean of the same over the other completions of its prompt (the leave-one-out baseline);
    with `normalize`, then standardised over the batch (unbiased standard deviation, plus 1e-4).

    Args:
        rewards (`torch.Tensor`), kl (`torch.Tensor`): per completion (N,), prompts' completions consecutive.
    """
    penalised = rewards - beta * kl if beta != 0.0 else rewards
    grouped = penalised.view(-1, num_generations)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    advantages = (grouped - others_mean).reshape(-1)
    if normalize:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-4)
    return advantages


def reference_rloo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    token_gradient_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    RLOO's loss over a micro-batch: `-min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)` per sequence, with
    `r = exp(sum_t mask * (logp - old_logp))`, averaged over the sequences.

    Its value is that loss; its gradient w.r.t. `logps[i, t]` is `token_gradient_weights[i, t]` (default 1) times
    `-A_i r_i mask[i, t] / B` where sequence i is not clipped, and 0 where it is (clipped: `A > 0` and
    `r > 1 + epsilon_high`, or `A < 0` and `r < 1 - epsilon_low`).

    Args:
        logps (`torch.Tensor`), old_logps (`torch.Tensor`), mask (`torch.Tensor`):
            (B, T): the policy's log-probabilities (with gradient), pi_old's, and the completion tokens.
        advantages (`torch.Tensor`): (B,).
        token_gradient_weights (`torch.Tensor`, *optional*): (B, T), constants.
    """
    mask = mask.to(logps.dtype)
    ratio = torch.exp(((logps.detach() - old_logps) * mask).sum(dim=1))
    clipped = ((advantages > 0) & (ratio > 1 + epsilon_high)) | ((advantages < 0) & (ratio < 1 - epsilon_low))
    surrogate = torch.where(clipped, ratio.clamp(1 - epsilon_low, 1 + epsilon_high), ratio) * advantages
    value = -surrogate.mean()
    per_sequence_gradient = torch.where(clipped, torch.zeros_like(ratio), -advantages * ratio) / len(ratio)
    weights = mask if token_gradient_weights is None else mask * token_gradient_weights
    linear = (per_sequence_gradient[:, None] * weights * logps).sum()
    return value + linear - linear.detach()


def clipped_sequences(logps, old_logps, mask, advantages, *, epsilon_low: float, epsilon_high: float) -> torch.Tensor:
    """Which sequences RLOO's clipping holds at these log-probabilities (B,), bool."""
    ratio = torch.exp(((logps.detach() - old_logps) * mask.to(logps.dtype)).sum(dim=1))
    return ((advantages > 0) & (ratio > 1 + epsilon_high)) | ((advantages < 0) & (ratio < 1 - epsilon_low))
