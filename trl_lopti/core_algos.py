"""The algorithm: Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti) as small pure tensor functions.

Everything in this file is exactly what arXiv 2505.12929 computes, written so that each piece can be tested on its
own. The trainer (`trl_lopti/trainer.py`) only wires these functions into TRL's `GRPOTrainer`.

Notation (shapes): `B` completions in a micro-batch, `T` completion tokens (padded).

- `old_per_token_logps` (B, T): log pi_old of each sampled token, under the policy that produced the batch, with the
  same temperature scaling the loss uses. Constants: no gradient flows through anything derived from them.
- `completion_mask` (B, T): 1 for a real completion token, 0 for padding (and for tool-output tokens where TRL masks
  them).

Advantage Reweighting:

    A'(i, t) = (alpha * pi_old(i, t) + (1 - alpha)) * A(i)

Lopti: split the completion tokens once by `pi_old < eta` into "low" and "high" and run the update twice, once with
only the low tokens active, once with only the high tokens active. A token is made inactive for a pass by giving it
a zero advantage, a zero KL term and a zero entropy-bonus gradient, without changing the loss normaliser, so that at
equal parameters `grad(low pass) + grad(high pass) == grad(plain GRPO)`.
"""

from __future__ import annotations

import torch


LOPTI_PASS_ORDERS: dict[str, tuple[str, str]] = {
    "low_first": ("low", "high"),  # the paper's method
    "high_first": ("high", "low"),  # the paper's ablation (training collapses); never the default
}


def advantage_reweighting_weights(old_per_token_logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """
    Per-token Advantage Reweighting factor `alpha * pi_old + (1 - alpha)`.

    Args:
        old_per_token_logps (`torch.Tensor`):
            Log-probabilities of the sampled tokens under the behaviour policy, shape (B, T).
        alpha (`float`):
            Reweighting strength in [0, 1]. `0.0` gives a weight of exactly 1 everywhere (plain GRPO).

    Returns:
        `torch.Tensor`: The weights, shape (B, T), detached, in `[1 - alpha, 1]`.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    old_probs = torch.exp(old_per_token_logps.detach().float())
    return (alpha * old_probs + (1.0 - alpha)).to(old_per_token_logps.dtype)


def token_level_advantages(advantages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """
    Broadcasts sequence-level advantages (B,) to token level (B, T); token-level advantages pass through.

    Args:
        advantages (`torch.Tensor`):
            Advantages of shape (B,) or (B, T).
        num_tokens (`int`):
            T, the number of completion positions.

    Returns:
        `torch.Tensor`: Advantages of shape (B, T).
    """
    if advantages.dim() == 1:
        return advantages.unsqueeze(1).expand(-1, num_tokens)
    if advantages.dim() == 2 and advantages.size(1) == num_tokens:
        return advantages
    raise ValueError(f"advantages must have shape (B,) or (B, {num_tokens}), got {tuple(advantages.shape)}")


def reweight_advantages(
    advantages: torch.Tensor, old_per_token_logps: torch.Tensor, alpha: float
) -> torch.Tensor:
    """
    Advantage Reweighting: `A'(i, t) = (alpha * pi_old(i, t) + 1 - alpha) * A(i)`.

    Args:
        advantages (`torch.Tensor`):
            Advantages of shape (B,) or (B, T).
        old_per_token_logps (`torch.Tensor`):
            Behaviour-policy log-probabilities, shape (B, T).
        alpha (`float`):
            Reweighting strength in [0, 1].

    Returns:
        `torch.Tensor`: Token-level advantages of shape (B, T).
    """
    weights = advantage_reweighting_weights(old_per_token_logps, alpha)
    return token_level_advantages(advantages, old_per_token_logps.size(1)) * weights


def low_probability_token_mask(
    old_per_token_logps: torch.Tensor, completion_mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """
    The Lopti split: completion tokens whose behaviour-policy probability is strictly below `threshold` (eta).

    Args:
        old_per_token_logps (`torch.Tensor`):
            Behaviour-policy log-probabilities, shape (B, T).
        completion_mask (`torch.Tensor`):
            1 for completion tokens that enter the loss, 0 elsewhere, shape (B, T).
        threshold (`float`):
            eta in (0, 1).

    Returns:
        `torch.Tensor`: Boolean mask (B, T), True for low-probability completion tokens. The high tokens are
        `completion_mask.bool() & ~low`.
    """
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must lie in (0, 1), got {threshold}")
    # Compare in log space: exp() of a float16/bfloat16 log-prob can round across the threshold.
    return (old_per_token_logps.detach().float() < torch.log(torch.tensor(threshold))) & completion_mask.bool()


def lopti_active_token_mask(
    old_per_token_logps: torch.Tensor, completion_mask: torch.Tensor, threshold: float, token_group: str
) -> torch.Tensor:
    """
    The tokens active in one Lopti pass.

    Args:
        old_per_token_logps (`torch.Tensor`):
            Behaviour-policy log-probabilities, shape (B, T).
        completion_mask (`torch.Tensor`):
            Completion-token mask, shape (B, T).
        threshold (`float`):
            eta in (0, 1).
        token_group (`str`):
            `"low"` (pi_old < eta) or `"high"` (pi_old >= eta).

    Returns:
        `torch.Tensor`: Boolean mask (B, T). The low and high masks are disjoint and their union is the completion
        mask.
    """
    low = low_probability_token_mask(old_per_token_logps, completion_mask, threshold)
    if token_group == "low":
        return low
    if token_group == "high":
        return completion_mask.bool() & ~low
    raise ValueError(f"token_group must be 'low' or 'high', got {token_group!r}")


def isolate_advantages(advantages: torch.Tensor, active_mask: torch.Tensor) -> torch.Tensor:
    """
    Zeroes the advantage of every inactive token.

    Args:
        advantages (`torch.Tensor`):
            Advantages of shape (B,) or (B, T).
        active_mask (`torch.Tensor`):
            Boolean mask of the active tokens, shape (B, T).

    Returns:
        `torch.Tensor`: Token-level advantages (B, T), zero where `active_mask` is False.
    """
    token_advantages = token_level_advantages(advantages, active_mask.size(1))
    return torch.where(active_mask, token_advantages, torch.zeros_like(token_advantages))


def stop_gradient_where_inactive(values: torch.Tensor, active_mask: torch.Tensor) -> torch.Tensor:
    """
    Keeps the values but lets gradient flow only through the active tokens.

    Used for the entropy bonus: its normaliser (the number of masked tokens) and its value stay as TRL computes
    them, while the inactive tokens contribute no gradient.

    Args:
        values (`torch.Tensor`):
            Per-token values, shape (B, T).
        active_mask (`torch.Tensor`):
            Boolean mask of the active tokens, shape (B, T).

    Returns:
        `torch.Tensor`: Same values; gradient only through active tokens.
    """
    return torch.where(active_mask, values, values.detach())


def neutralize_inactive_kl(
    ref_per_token_logps: torch.Tensor, per_token_logps: torch.Tensor, active_mask: torch.Tensor
) -> torch.Tensor:
    """
    Reference log-probabilities that make the k3 KL term of every inactive token zero in value and gradient.

    TRL's per-token KL is `k3(d) = exp(d) - d - 1` with `d = ref - logp` (optionally times the differentiable
    importance ratio). Setting `ref := logp.detach()` for an inactive token gives `d = 0`, where both `k3` and its
    derivative `1 - exp(d)` vanish, so the token adds neither loss nor gradient whatever the KL options; the
    normaliser is untouched.

    Args:
        ref_per_token_logps (`torch.Tensor`):
            Reference-model log-probabilities, shape (B, T).
        per_token_logps (`torch.Tensor`):
            Current-policy log-probabilities (with gradient), shape (B, T).
        active_mask (`torch.Tensor`):
            Boolean mask of the active tokens, shape (B, T).

    Returns:
        `torch.Tensor`: Reference log-probabilities to use for this pass, shape (B, T), without gradient.
    """
    return torch.where(active_mask, ref_per_token_logps, per_token_logps.detach())
