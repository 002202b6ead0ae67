"""An independent implementation of TRL's GRPO loss, written from the formulas, to check the trainer against.

Nothing here imports trl or trl_lopti: the trainer's numbers must match numbers computed another way.
"""

from __future__ import annotations

import torch


def completion_logps_and_entropies(model, inputs: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the sampled completion tokens and the entropies, from a plain forward of `model`."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    num_completion_tokens = inputs["completion_ids"].size(1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, -num_completion_tokens - 1 : -1, :]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # float64 stays float64
    log_probs = torch.log_softmax(logits, dim=-1)
    logps = log_probs.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    entropies = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropies


def reference_grpo_loss(
    logps: torch.Tensor,
    entropies: torch.Tensor,
    old_logps: torch.Tensor,
    token_advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    kl_mask: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    entropy_grad_mask: torch.Tensor | None = None,
    num_items_in_batch: float | None = None,
    max_completion_length: int | None = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    importance_sampling_ratio: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    grad_mask: torch.Tensor | None = None,
    gradient_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    The GRPO-family loss of one micro-batch, as TRL 1.16 defines it (token- or sequence-level importance sampling,
    bias-corrected k3 KL), with per-token advantages.

    `kl_mask` multiplies the KL term per token (1 keeps it). `entropy_grad_mask` lets the entropy bonus gradient
    flow only through the selected tokens (its value and normaliser stay those of all completion tokens).
    `grad_mask` lets gradient flow only through the selected tokens' log-probabilities and entropies (every value
    unchanged): Lopti's isolation in its general form. `gradient_weights` scales the gradient through each token's
    log-probability (every value unchanged): AR's general form, for a ratio the tokens of a sequence share.
    """
    mask = mask.float()
    if gradient_weights is not None:
        logps = gradient_weights * logps + (1 - gradient_weights) * logps.detach()
    if grad_mask is not None:
        logps = torch.where(grad_mask.bool(), logps, logps.detach())
        entropies = torch.where(grad_mask.bool(), entropies, entropies.detach())
    if importance_sampling_level == "sequence":
        log_ratio = ((logps - old_logps) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    else:
        log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.minimum(ratio * token_advantages, clipped_ratio * token_advantages)
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        log_ratio_to_ref = ref_logps - logps
        per_token_kl = (torch.exp(log_ratio_to_ref) - log_ratio_to_ref - 1) * ratio
        if kl_mask is not None:
            per_token_kl = per_token_kl * kl_mask
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean() / gradient_accumulation_steps
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1) / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
        loss = loss / gradient_accumulation_steps
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean() / gradient_accumulation_steps
    elif loss_type == "dapo":
        normalizer = max(float(num_items_in_batch), 1.0) * gradient_accumulation_steps / steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
    else:
        raise ValueError(loss_type)
    if entropy_coef != 0.0:
        if entropy_grad_mask is not None:
            entropies = torch.where(entropy_grad_mask.bool(), entropies, entropies.detach())
        entropy_bonus = (entropies * mask).sum() / mask.sum().clamp(min=1) / gradient_accumulation_steps
        loss = loss - entropy_coef * entropy_bonus
    return loss
