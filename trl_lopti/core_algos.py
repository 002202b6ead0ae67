"""Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti) as small pure tensor functions.

Exactly what arXiv 2505.12929 computes, each piece testable on its own; `trl_lopti/lopti_mixin.py` and the
two trainers (`grpo_trainer.py`, `rloo_trainer.py`) wire them into TRL.

Shapes: `B` completions, `T` completion tokens (padded). `old_per_token_logps` (B, T) is log pi_old of each
sampled token under the policy that produced the batch, at the loss's temperature (a constant: no gradient
flows through it). `completion_mask` (B, T) is 1 for a completion token the loss counts, 0 for padding (and
masked tool output).

- AR: `A'(i, t) = (alpha * pi_old(i, t) + (1 - alpha)) * A(i)` ([`reweight_advantages`]). Where a sequence's
  tokens share one ratio, its general form scales the gradient through each token by that weight
  ([`reweight_token_gradients`]).
- Lopti: split the completion tokens once by `pi_old < eta` ([`low_probability_token_mask`], eta fixed or
  [`lopti_batch_threshold`]) and run the update once per group, with gradient only through that group's
  tokens ([`isolate_token_gradients`]).
- REINFORCE++ (outcome reward, gamma 1): [`reinforce_plus_plus_advantages`].
"""

import torch


# The paper's method updates the low tokens first; the other order is its ablation (training collapses), never the
# default.
LOPTI_PASS_ORDERS: dict[str, tuple[str, ...]] = {
    "low_first": ("low", "high"),
    "high_first": ("high", "low"),
}

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "reinforce_plus_plus")


def advantage_reweighting_weights(old_per_token_logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """The per-token AR factor `alpha * pi_old + (1 - alpha)` (B, T), detached, in `[1 - alpha, 1]`, of
    behaviour-policy log-probabilities (B, T), for alpha in [0, 1] (`0.0`: exactly 1, plain GRPO)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    old_probs = torch.exp(_at_least_float32(old_per_token_logps.detach()))
    return (alpha * old_probs + (1.0 - alpha)).to(old_per_token_logps.dtype)


def token_level_advantages(advantages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Advantages (B,) broadcast to token level (B, `num_tokens`); advantages (B, T) pass through."""
    if advantages.dim() == 1:
        return advantages.unsqueeze(1).expand(-1, num_tokens)
    if advantages.dim() == 2 and advantages.size(1) == num_tokens:
        return advantages
    raise ValueError(f"advantages must have shape (B,) or (B, {num_tokens}), got {tuple(advantages.shape)}")


def reweight_advantages(advantages: torch.Tensor, old_per_token_logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """Advantage Reweighting: the token-level (B, T) `A'(i, t) = (alpha * pi_old(i, t) + 1 - alpha) * A(i)`
    of advantages (B,) or (B, T), for behaviour-policy log-probabilities (B, T) and alpha in [0, 1]."""
    weights = advantage_reweighting_weights(old_per_token_logps, alpha)
    return token_level_advantages(advantages, old_per_token_logps.size(1)) * weights


def reweight_token_gradients(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """
    Advantage Reweighting in its general form: keeps every value, scales each token's gradient by its weight.

    Applied to the per-token log-probabilities (B, T) of the policy before a loss reads them, with the AR
    weights `alpha * pi_old + 1 - alpha` ([`advantage_reweighting_weights`]), it makes the gradient of the
    loss w.r.t. each token's log-probability `w(i, t)` times the plain loss's, and changes no value the loss
    computes. Where the tokens of a sequence share one ratio (RLOO, GRPO's
    `importance_sampling_level="sequence"`) this is how AR enters; for a token-level loss without KL it
    equals the paper's `A'(i, t) = w(i, t) * A(i)`, since `min(r w A, clip(r) w A) = w min(r A, clip(r) A)`
    for `w > 0`. It composes with [`isolate_token_gradients`] in either order.

    Args:
        values (`torch.Tensor`):
            Per-token values (log-probabilities) (B, T).
        weights (`torch.Tensor`):
            The gradient weight of each value (B, T); a constant (no gradient flows through it).
    """
    detached = values.detach()
    return detached + weights.detach().to(values.dtype) * (values - detached)


def low_probability_token_mask(
    old_per_token_logps: torch.Tensor, completion_mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """The Lopti split: a boolean mask (B, T) of the completion tokens (`completion_mask`) whose
    behaviour-policy probability (`old_per_token_logps`, B x T) is strictly below `threshold`
    (eta in [0, 1]). The high tokens are the others ([`token_group_mask`])."""
    threshold = float(threshold)
    # A batch's quantile can reach 0 or 1; a user's eta is checked to lie in (0, 1).
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
    # Compare in probability space, as the authors do and as `lopti_batch_threshold` computes eta, so that a
    # token whose p is the batch's quantile stays high. In log space it would not: log(exp(x)) rounds above x
    # for some x, making x low.
    return (torch.exp(_at_least_float32(old_per_token_logps.detach())) < threshold) & completion_mask.bool()


def lopti_batch_threshold(old_per_token_logps: torch.Tensor, completion_mask: torch.Tensor, quantile: float) -> float:
    """
    The quantile split rule: eta of a generation batch is the `quantile` quantile of pi_old over its tokens.

    As the paper's authors compute it (`seperate_portion` in their release): the quantile of the
    probabilities `exp(old_per_token_logps)` (not of the log-probabilities) over the real completion tokens
    (padding excluded), with linear interpolation between neighbouring values, as `torch.quantile` does (and
    without its limit of 2**24 values). The split is then `pi_old < eta` ([`low_probability_token_mask`]), so
    about a share `quantile` of the tokens is low however the policy's confidence drifts.

    Args:
        old_per_token_logps (`torch.Tensor`):
            Behaviour-policy log-probabilities of the whole generation batch (all processes), any shape.
        completion_mask (`torch.Tensor`):
            Mask of the same shape: nonzero for the tokens that count (the loss's completion tokens), zero
            for padding.
        quantile (`float`):
            The level q in (0, 1).

    Returns:
        `float`: eta in [0, 1]; 0.0 when the batch has no token (then no token is low).
    """
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must lie in (0, 1), got {quantile}")
    probabilities = torch.exp(_at_least_float32(old_per_token_logps.detach()))[completion_mask.bool()]
    if probabilities.numel() == 0:
        return 0.0
    ordered = torch.sort(probabilities).values
    position = torch.tensor(quantile, dtype=ordered.dtype) * (ordered.numel() - 1)
    below = position.floor()
    above = (below + 1).clamp(max=ordered.numel() - 1)
    return float(torch.lerp(ordered[below.long()], ordered[above.long()], position - below))


def loss_token_mask(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens (B, T) TRL's GRPO loss sums over: `completion_mask`, times `tool_mask` if any."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if inputs.get("tool_mask") is not None else mask


def token_group_mask(low_mask: torch.Tensor, completion_mask: torch.Tensor, token_group: str) -> torch.Tensor:
    """The tokens (B, T) of Lopti's group `"low"` (`low_mask`) or `"high"` (the other completion tokens)."""
    if token_group == "low":
        return low_mask
    if token_group == "high":
        return completion_mask.bool() & ~low_mask
    raise ValueError(f"token_group must be 'low' or 'high', got {token_group!r}")


def isolate_token_gradients(values: torch.Tensor, active_mask: torch.Tensor) -> torch.Tensor:
    """
    Lopti token isolation in its general form: keeps every value, with gradient only through active tokens.

    Applied to the per-token log-probabilities and entropies of the policy before the loss reads them, it
    makes every term of the loss (advantages, ratios, clipping, KL, entropy bonus, normaliser) keep the value
    plain GRPO computes, while the gradient of the loss w.r.t. each inactive token's log-probability and
    entropy is exactly zero.

    Args:
        values (`torch.Tensor`):
            Per-token values (log-probabilities or entropies) (B, T).
        active_mask (`torch.Tensor`):
            Boolean mask of the active tokens (B, T).
    """
    return torch.where(active_mask, values, values.detach())


def reinforce_plus_plus_advantages(rewards: torch.Tensor, completion_lengths: torch.Tensor) -> torch.Tensor:
    """
    REINFORCE++ advantages for outcome rewards with gamma = 1, one per completion.

    Each completion's return is its reward at every one of its tokens; the returns are whitened over all
    completion tokens of the batch: `A(i) = (R(i) - m) / sqrt(v + 1e-8)`, where `m` and `v` are the mean and
    the unbiased (n - 1) variance of the returns over the `n` completion tokens (a completion of length L
    counts L times). There is no per-prompt baseline. Completions without tokens, or with a NaN reward
    (unscorable), get 0 and do not count.

    Args:
        rewards (`torch.Tensor`):
            One reward per completion of the whole generation batch (every process), shape (N,).
        completion_lengths (`torch.Tensor`):
            The number of loss tokens of each completion, shape (N,).

    Returns:
        `torch.Tensor`: Advantages of shape (N,), float32.
    """
    if rewards.shape != completion_lengths.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and completion_lengths must both have shape (N,), got {tuple(rewards.shape)} and "
            f"{tuple(completion_lengths.shape)}"
        )
    rewards = rewards.float()
    weights = torch.where(torch.isnan(rewards), 0.0, completion_lengths.float())
    rewards = torch.nan_to_num(rewards, nan=0.0)
    num_tokens = weights.sum()
    mean = (weights * rewards).sum() / num_tokens.clamp(min=1.0)
    variance = (weights * (rewards - mean) ** 2).sum() / (num_tokens - 1.0).clamp(min=1.0)
    advantages = (rewards - mean) * torch.rsqrt(variance + 1e-8)
    return torch.where(weights > 0, advantages, torch.zeros_like(advantages))


def _at_least_float32(values: torch.Tensor) -> torch.Tensor:
    """Half-precision values in float32 (exp() in half precision rounds too coarsely); others unchanged."""
    return values.to(torch.promote_types(values.dtype, torch.float32))
