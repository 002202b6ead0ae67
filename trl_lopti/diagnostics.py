"""Token-probability diagnostics: measure whether low-probability tokens dominate a GRPO update in *your* run.

arXiv 2505.12929 argues from a measurement: group the completion tokens of a batch by the probability of the sampled
token, and the low-probability groups produce larger gradients (Fig. 1d), move the high-probability tokens more than
these tokens' own update does (Fig. 1e/f), and AR/Lopti raise the share of tokens whose probability moves in the
direction of their advantage (Fig. 3). This module measures those quantities, and the ones its reviewers asked for,
on any causal LM and any batch in the format of TRL's `GRPOTrainer` (`inputs` of `_generate_and_score_completions`).

Conventions (all exact, see `grpo_token_weights`):

- Per-token loss of TRL's clipped surrogate, token-level ratio `r = pi / pi_old`:
  `loss_t = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) + beta * k3_t`, `k3 = pi_ref/pi - log(pi_ref/pi) - 1`
  (times `r` with `use_bias_correction_kl=True`, TRL's default and ours). The loss of a batch is
  `sum_t c_t * loss_t`, with `c_t` the normaliser of `loss_type` (`dapo`/`bnpo`: one over the number of completion
  tokens).
- The token weight `w_t` is defined by `d loss_t / d log pi_t = -w_t`, so a positive `w` pushes the token's probability
  up. "Without KL" is `w_pg = r * A * 1[not clipped]`; "with KL" is `w = w_pg + w_kl`, where
  `w_kl = beta * (pi_ref / pi - 1)` for the plain k3 term and `w_kl = beta * r * (pi_ref / pi - 1 - k3)` with the
  bias correction. At the behaviour policy `r = 1` and nothing is clipped; at the reference policy `w_kl = 0`.
- Because `d log pi_t / d logits_t = (e_k - p_t) / temperature`, the gradient of `loss_t` w.r.t. the last hidden
  state (the input of the LM head, `logits = h @ W.T`) is `-w_t * W.T @ (e_k - p_t) / temperature` at position t and
  zero at every other position. This module computes its norm in closed form from the logits and `W`, for all tokens
  at once. Its ratio to `|w| * (1 - pi)` lies in `[0, sqrt(2) * sigma_max(W) / temperature]` because
  `(1 - pi) <= ||e_k - p|| <= sqrt(2) * (1 - pi)`.
- Tokens are grouped by `pi_old` (the behaviour-policy probability: `inputs["old_per_token_logps"]` when present,
  otherwise the model's own probability, which is what TRL uses on-policy) into quartiles over the batch's completion
  tokens: Q1 = `[min, e1)`, Q2 = `[e1, e2)`, Q3 = `[e2, e3)`, Q4 = `[e3, max]`, with the edges `e1, e2, e3` reported.
- Summed parameter gradients are those of `sum_{t in quartile} c_t * loss_t`; they add up exactly to the full
  gradient. They are accumulated into one flat float32 buffer per quartile (memory: 4 x number of trainable
  parameters x 4 bytes, independent of the number of tokens); per-token parameter gradients are never formed.

Entry points: `measure_token_gradients` (quartile table), `probability_shift_probe` (one-update probe),
`run_token_diagnostics` (both, sharing the gradient computation), `advance_policy_on_batch` (measure at a later inner
iteration, where ratios, clipping and the KL part are active), `TokenDiagnosticsCallback` (during training),
`diagnose_main` (the `trl-lopti diagnose` command).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from .core_algos import low_probability_token_mask, reweight_advantages, token_level_advantages


logger = logging.getLogger(__name__)

QUARTILE_LABELS = ("Q1 (lowest)", "Q2", "Q3", "Q4 (highest)")
PROBE_METHODS = ("grpo", "ar", "lopti", "lopti_ar", "lowest_quartile_only", "highest_quartile_only")
DEFAULT_PROBE_METHODS = ("grpo", "ar", "lopti", "lowest_quartile_only", "highest_quartile_only")
SUPPORTED_LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")
_PROBE_SIGNS = ("positive", "negative")


# ---------------------------------------------------------------------------------------------------------------------
# Pure per-token quantities
# ---------------------------------------------------------------------------------------------------------------------


def grpo_token_weights(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    ref_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    use_bias_correction_kl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Token weights of TRL's clipped GRPO surrogate, split into the policy-gradient part and the KL part.

    The weight is defined by `d loss_t / d log pi_t = -(w_pg + w_kl)`: a positive weight raises the token's
    probability under gradient descent. `w_pg = r * A * 1[not clipped]` with `r = exp(logp - old_logp)`;
    `w_kl = beta * (pi_ref / pi - 1)` for TRL's k3 estimator, or `-beta * r * (k3 + 1 - pi_ref / pi)` when the KL
    term is multiplied by the importance ratio (`use_bias_correction_kl=True`).

    Args:
        per_token_logps (`torch.Tensor`):
            Log-probabilities of the sampled tokens under the current policy, shape (B, T).
        old_per_token_logps (`torch.Tensor`):
            Log-probabilities under the behaviour policy, shape (B, T).
        advantages (`torch.Tensor`):
            Advantages, shape (B,) or (B, T).
        ref_per_token_logps (`torch.Tensor` or `None`, *optional*):
            Log-probabilities under the reference policy, shape (B, T). `None` makes the KL part zero.
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient.
        epsilon_low (`float`, *optional*, defaults to `0.2`):
            Lower clipping range.
        epsilon_high (`float` or `None`, *optional*):
            Upper clipping range; defaults to `epsilon_low`.
        use_bias_correction_kl (`bool`, *optional*, defaults to `True`):
            Whether the KL term is multiplied by the (differentiable) importance ratio, as TRL's
            `use_bias_correction_kl`.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: `(w_pg, w_kl)`, each of shape (B, T), detached, float32.
    """
    logps = per_token_logps.detach().float()
    old = old_per_token_logps.detach().float()
    adv = token_level_advantages(advantages.detach().float(), logps.size(1))
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - old)
    clipped = ((adv > 0) & (ratio > 1 + epsilon_high)) | ((adv < 0) & (ratio < 1 - epsilon_low))
    w_pg = torch.where(clipped, torch.zeros_like(ratio), ratio * adv)
    if ref_per_token_logps is None or beta == 0.0:
        return w_pg, torch.zeros_like(w_pg)
    delta = ref_per_token_logps.detach().float() - logps  # log(pi_ref / pi)
    dk3_dlogp = 1.0 - torch.exp(delta)
    if use_bias_correction_kl:
        k3 = torch.exp(delta) - delta - 1.0
        dkl_dlogp = ratio * (k3 + dk3_dlogp)
    else:
        dkl_dlogp = dk3_dlogp
    return w_pg, -beta * dkl_dlogp


def loss_normalizer(
    completion_mask: torch.Tensor, loss_type: str = "dapo", max_completion_length: int | None = None
) -> torch.Tensor:
    """
    The factor `c_t` with which each token's loss enters the batch loss `sum_t c_t * loss_t`.

    Args:
        completion_mask (`torch.Tensor`):
            Completion-token mask, shape (B, T).
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            `"dapo"` or `"bnpo"` (one over all completion tokens of the batch), `"grpo"` (one over `B` times the
            completion's length) or `"dr_grpo"` (one over `B * max_completion_length`).
        max_completion_length (`int` or `None`, *optional*):
            For `"dr_grpo"`; defaults to `T`.

    Returns:
        `torch.Tensor`: Shape (B, T), zero on padding.
    """
    mask = completion_mask.float()
    if loss_type in ("dapo", "bnpo"):
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * mask.size(0))
    if loss_type == "dr_grpo":
        return mask / (mask.size(0) * (max_completion_length or mask.size(1)))
    raise ValueError(f"loss_type must be one of {SUPPORTED_LOSS_TYPES}, got {loss_type!r}")


def probability_quartiles(
    probs: torch.Tensor, mask: torch.Tensor, quantiles: Sequence[float] = (0.25, 0.5, 0.75)
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Assigns every masked token to a probability group by the batch's quantiles of `probs`.

    Args:
        probs (`torch.Tensor`):
            Probabilities, shape (B, T).
        mask (`torch.Tensor`):
            Tokens to group, shape (B, T).
        quantiles (`Sequence[float]`, *optional*, defaults to `(0.25, 0.5, 0.75)`):
            Quantile levels of the edges.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: `(edges, group)`: the edges (len(quantiles),) and the group index (B, T)
        in `[0, len(quantiles)]`, `-1` outside the mask. Group `j` is `[edge_{j-1}, edge_j)`; the last group includes
        its upper end.
    """
    mask = mask.bool()
    values = probs.detach().double()[mask]
    if values.numel() == 0:
        edges = torch.full((len(quantiles),), float("nan"), dtype=torch.float64)
        return edges, torch.full_like(mask, -1, dtype=torch.long)
    levels = torch.tensor(list(quantiles), dtype=torch.float64)
    edges = torch.quantile(values, levels) if values.numel() <= 16_000_000 else _sorted_quantiles(values, levels)
    group = torch.bucketize(probs.detach().double(), edges.to(probs.device), right=True)
    return edges.cpu(), torch.where(mask, group, torch.full_like(group, -1))


def _sorted_quantiles(values: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    ordered = values.sort().values
    positions = levels * (ordered.numel() - 1)
    low, high = positions.floor().long(), positions.ceil().long()
    return ordered[low] + (ordered[high] - ordered[low]) * (positions - low)


def hidden_state_gradient_norms(
    logits: torch.Tensor, token_ids: torch.Tensor, lm_head_weight: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Closed-form norm of `d log pi_t / d h_t`, the gradient of a token's log-probability w.r.t. the LM head's input.

    With `logits = h @ W.T` and `log pi_t = log_softmax(logits / temperature)[k_t]`, the gradient is
    `W.T @ (e_k - p_t) / temperature`. Multiply by `|w_t|` for the gradient of the token's loss. The entry `1 - p_k`
    of `e_k - p` is formed as the sum of the other tokens' probabilities, which stays precise when `p_k` is within
    float32 rounding of one (where `1 - exp(log p_k)` would be zero).

    Args:
        logits (`torch.Tensor`):
            Raw logits (before temperature) of the positions that predict the tokens, shape (B, T, V).
        token_ids (`torch.Tensor`):
            The sampled tokens, shape (B, T).
        lm_head_weight (`torch.Tensor`):
            `W`, shape (V, H).
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature the log-probabilities are computed with.

    Returns:
        `tuple[torch.Tensor, torch.Tensor, torch.Tensor]`: `(norms, logps, one_minus_p)`, each (B, T):
        `||d log pi_t / d h_t||`, `log pi_t` (computed in float64) and `1 - pi_t`.
    """
    index = token_ids.long().unsqueeze(-1)
    logps = _precise_logps(logits, index, temperature)
    logp_all = torch.log_softmax(logits.detach().float() / temperature, dim=-1)
    direction = logp_all.exp_().neg_()  # -p, then e_k - p, in place of the log-probabilities to save memory
    direction.scatter_(-1, index, 0.0)
    one_minus_p = -direction.sum(-1)
    direction.scatter_(-1, index, one_minus_p.unsqueeze(-1))
    weight = lm_head_weight.detach().float()
    norms = torch.linalg.vector_norm(direction @ weight, dim=-1) / temperature
    return norms, logps, one_minus_p


def _precise_logps(logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi of the tokens `index` (B, T, 1), with the log-sum-exp in float64 (probe shifts can be ~1e-6)."""
    scaled = logits.detach().double() / temperature
    return scaled.gather(-1, index).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def lm_head_spectral_norm(lm_head_weight: torch.Tensor) -> float:
    """
    Largest singular value of the LM head weight `W` (V, H), via the (H, H) Gram matrix.

    Args:
        lm_head_weight (`torch.Tensor`):
            `W`, shape (V, H).

    Returns:
        `float`: `sigma_max(W)`.
    """
    weight = lm_head_weight.detach().double()
    return float(torch.linalg.eigvalsh(weight.T @ weight).max().clamp(min=0.0).sqrt())


# ---------------------------------------------------------------------------------------------------------------------
# Batch handling and forward passes
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Batch:
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor  # (B, T) float32
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    share_prompts: bool = True

    @property
    def size(self) -> int:
        return self.completion_ids.size(0)


def _batch_from_inputs(inputs: dict[str, Any], device: torch.device) -> _Batch:
    missing = [key for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
               if key not in inputs]
    if missing:
        raise KeyError(f"inputs lacks {missing}; expected the dict of GRPOTrainer._generate_and_score_completions")
    completion_mask = inputs["completion_mask"].to(device)
    if inputs.get("tool_mask") is not None:
        completion_mask = completion_mask * inputs["tool_mask"].to(device)
    num_tokens = inputs["completion_ids"].size(1)
    advantages = token_level_advantages(inputs["advantages"].to(device).float(), num_tokens).clone()

    def optional(key: str) -> torch.Tensor | None:
        value = inputs.get(key)
        return None if value is None else value.to(device).float()

    return _Batch(
        prompt_ids=inputs["prompt_ids"].to(device),
        prompt_mask=inputs["prompt_mask"].to(device),
        completion_ids=inputs["completion_ids"].to(device),
        completion_mask=completion_mask.long(),
        advantages=advantages,
        old_logps=optional("old_per_token_logps"),
        ref_logps=optional("ref_per_token_logps"),
    )


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"the closed-form hidden-state gradient needs a linear LM head, got {type(head).__name__}")
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None):
        raise ValueError("the closed-form hidden-state gradient does not hold with final_logit_softcapping")
    return head.weight


def _micro_batches(batch_size: int, micro_batch_size: int) -> list[slice]:
    micro_batch_size = max(1, int(micro_batch_size))
    starts = range(0, batch_size, micro_batch_size)
    return [slice(start, min(start + micro_batch_size, batch_size)) for start in starts]


def _completion_logits(model: torch.nn.Module, batch: _Batch, rows: slice) -> tuple[torch.Tensor, int] | None:
    """Raw logits (b, T_eff, V) predicting the completion tokens of `rows`, `T_eff` the last used column + 1.

    Left columns that are padding in every row and right columns that are masked in every row are dropped: for
    rotary-position models this changes nothing (attention depends on relative positions) and saves compute. When
    rows share a prompt (the generations of one prompt), the prompt is run once and its key/value cache is shared
    (see `_shared_prompt_logits`); the result is the same as a forward of every full sequence.
    """
    prompt_mask = batch.prompt_mask[rows]
    completion_mask = batch.completion_mask[rows]
    used = completion_mask.bool().any(0).nonzero()
    if used.numel() == 0:
        return None
    num_tokens = int(used.max()) + 1
    prompt_used = prompt_mask.bool().any(0).nonzero()
    start = int(prompt_used.min()) if prompt_used.numel() else 0
    prompt_ids, prompt_mask = batch.prompt_ids[rows, start:], prompt_mask[:, start:]
    completion_ids, completion_mask = batch.completion_ids[rows, :num_tokens], completion_mask[:, :num_tokens]
    if batch.share_prompts and prompt_ids.size(0) > 1 and prompt_ids.size(1) > 0:
        logits = _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        if logits is not None:
            return logits, num_tokens
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    output = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=num_tokens + 1, use_cache=False)
    logits = output.logits if hasattr(output, "logits") else output
    return logits[:, -(num_tokens + 1) : -1, :], num_tokens


def _shared_prompt_logits(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor | None:
    """Completion logits with one prompt forward per distinct prompt; `None` when no prompt repeats or the model has
    no batch-selectable key/value cache (then the caller runs full sequences).

    The prompts' cache is gathered to the rows (`batch_select_indices`, differentiable), so gradients flow into the
    prompt positions exactly as in a full forward; positions continue from the padded prompt length as they do there.
    """
    keys = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    if unique.size(0) == prompt_ids.size(0):
        return None
    first = torch.zeros(unique.size(0), dtype=torch.long, device=prompt_ids.device)
    first.scatter_(0, inverse.flip(0), torch.arange(prompt_ids.size(0) - 1, -1, -1, device=prompt_ids.device))
    num_tokens = completion_ids.size(1)
    try:
        output = model(
            input_ids=prompt_ids[first], attention_mask=prompt_mask[first], use_cache=True, logits_to_keep=1
        )
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        if cache is None or not hasattr(cache, "batch_select_indices"):
            return None
        # transformers >= 5.x names the argument `cache`; earlier versions `past_key_values`
        cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cache.batch_select_indices(inverse)
        first_logits = output.logits[:, -1:, :][inverse]
        if num_tokens == 1:
            return first_logits
        attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)
        rest = model(
            input_ids=completion_ids[:, :-1], attention_mask=attention_mask, use_cache=True,
            logits_to_keep=num_tokens - 1, **{cache_kwarg: cache},
        ).logits
    except (TypeError, AttributeError, NotImplementedError):
        return None
    return torch.cat([first_logits, rest], dim=1)


@torch.no_grad()
def _token_statistics(
    model: torch.nn.Module, batch: _Batch, temperature: float, micro_batch_size: int, hidden_norms: bool
) -> dict[str, torch.Tensor]:
    """One no-grad forward: log-probabilities and (optionally) `||d log pi / d h||` of every completion token."""
    shape = batch.completion_ids.shape
    device = batch.completion_ids.device
    logps = torch.zeros(shape, dtype=torch.float64, device=device)
    norms = torch.zeros(shape, dtype=torch.float32, device=device)
    one_minus_p = torch.zeros(shape, dtype=torch.float32, device=device)
    weight = _lm_head_weight(model) if hidden_norms else None
    for rows in _micro_batches(batch.size, micro_batch_size):
        result = _completion_logits(model, batch, rows)
        if result is None:
            continue
        logits, num_tokens = result
        token_ids = batch.completion_ids[rows, :num_tokens]
        if hidden_norms:
            mb_norms, mb_logps, mb_one_minus_p = hidden_state_gradient_norms(logits, token_ids, weight, temperature)
            norms[rows, :num_tokens] = mb_norms
            one_minus_p[rows, :num_tokens] = mb_one_minus_p
        else:
            mb_logps = _precise_logps(logits, token_ids.long().unsqueeze(-1), temperature)
        logps[rows, :num_tokens] = mb_logps
        del logits
    mask = batch.completion_mask.bool()
    return {
        "logps": logps.masked_fill(~mask, 0.0),
        "hidden_norms": norms.masked_fill(~mask, 0.0),
        "one_minus_p": one_minus_p.masked_fill(~mask, 0.0),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Gradients of weighted token losses
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _GradSpec:
    """Which tokens are active (`tokens`: "all", "q0".."q3", "low", "high") and with which advantages ("A", "AR")."""

    tokens: str
    advantages: str = "A"


@dataclass
class _LossSettings:
    temperature: float
    beta: float
    epsilon_low: float
    epsilon_high: float | None
    loss_type: str
    use_bias_correction_kl: bool
    max_completion_length: int | None
    alpha: float
    eta: float


class _TokenContext:
    """Per-token constants of one batch: pi_old, quartiles, Lopti split, normaliser, reweighted advantages."""

    def __init__(self, batch: _Batch, logps_before: torch.Tensor, settings: _LossSettings):
        self.mask = batch.completion_mask.bool()
        old_logps = batch.old_logps if batch.old_logps is not None else logps_before
        self.old_logps = old_logps.masked_fill(~self.mask, 0.0)
        self.edges, self.quartile = probability_quartiles(self.old_logps.exp(), self.mask)
        self.low = low_probability_token_mask(self.old_logps, self.mask, settings.eta)
        self.normalizer = loss_normalizer(batch.completion_mask, settings.loss_type, settings.max_completion_length)
        self.advantages = {
            "A": batch.advantages,
            "AR": reweight_advantages(batch.advantages, self.old_logps, settings.alpha),
        }

    def active(self, tokens: str) -> torch.Tensor:
        if tokens == "all":
            return self.mask
        if tokens == "low":
            return self.low
        if tokens == "high":
            return self.mask & ~self.low
        if tokens.startswith("q"):
            return self.quartile == int(tokens[1:])
        raise ValueError(f"unknown token group {tokens!r}")


def _trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [param for param in model.parameters() if param.requires_grad]


def _weighted_gradients(
    model: torch.nn.Module,
    batch: _Batch,
    context: _TokenContext,
    specs: Sequence[_GradSpec],
    settings: _LossSettings,
    micro_batch_size: int,
) -> dict[_GradSpec, torch.Tensor]:
    """Flat float32 gradients of `sum_t c_t * loss_t` over each spec's active tokens, at the model's parameters.

    Per micro-batch: one forward with grad, then one backward per spec of `sum_t coef_t * log pi_t` with the detached
    coefficient `coef_t = -c_t * w_t * active_t`, whose gradient equals that of the masked GRPO loss (see the module
    docstring). Gradients go through `torch.autograd.grad`, so `param.grad` is never touched.
    """
    params = _trainable_parameters(model)
    sizes = [param.numel() for param in params]
    device = _model_device(model)
    buffers = {spec: torch.zeros(sum(sizes), dtype=torch.float32, device=device) for spec in specs}
    if not specs:
        return buffers
    kl_active = settings.beta != 0.0 and batch.ref_logps is not None
    for rows in _micro_batches(batch.size, micro_batch_size):
        if not kl_active and not any(  # e.g. a group whose rewards are all equal: no gradient, skip its forward
            bool((context.active(spec.tokens)[rows] & (context.advantages[spec.advantages][rows] != 0)).any())
            for spec in specs
        ):
            continue
        result = _completion_logits(model, batch, rows)
        if result is None:
            continue
        logits, num_tokens = result
        cols = slice(0, num_tokens)
        token_ids = batch.completion_ids[rows, cols].long()
        scaled = logits.float() / settings.temperature
        logps = scaled.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        ref = None if batch.ref_logps is None else batch.ref_logps[rows, cols]
        coefficients = []
        for spec in specs:
            w_pg, w_kl = grpo_token_weights(
                logps, context.old_logps[rows, cols], context.advantages[spec.advantages][rows, cols], ref,
                settings.beta, settings.epsilon_low, settings.epsilon_high, settings.use_bias_correction_kl,
            )
            active = context.active(spec.tokens)[rows, cols].float()
            coefficients.append(-(w_pg + w_kl) * context.normalizer[rows, cols] * active)
        for index, (spec, coefficient) in enumerate(zip(specs, coefficients)):
            last = index == len(specs) - 1
            if not bool(coefficient.ne(0).any()):
                continue
            grads = torch.autograd.grad(
                (coefficient * logps).sum(), params, retain_graph=not last, allow_unused=True
            )
            offset = 0
            for grad, size in zip(grads, sizes):
                if grad is not None:
                    buffers[spec][offset : offset + size] += grad.reshape(-1).float()
                offset += size
            del grads
        del logits, scaled, logps
    return buffers


def _dot(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 22) -> float:
    """Dot product of two flat vectors accumulated in float64, chunk by chunk (float32 reductions over ~1e8 entries
    are off by about a percent; converting whole vectors would double their memory)."""
    return sum(float(a[i : i + chunk].double() @ b[i : i + chunk].double()) for i in range(0, a.numel(), chunk))


def _norm(a: torch.Tensor) -> float:
    return math.sqrt(max(_dot(a, a), 0.0))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    denominator = _norm(a) * _norm(b)
    return _dot(a, b) / denominator if denominator > 0 else None


# ---------------------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------------------


def _stat(values: torch.Tensor, how: str) -> float | None:
    values = values.double()
    values = values[torch.isfinite(values)]
    if values.numel() == 0:
        return None
    if how == "mean":
        return float(values.double().mean())
    if how == "median":
        return float(torch.quantile(values.double(), 0.5))  # the mean of the two middle values for even counts
    if how == "max":
        return float(values.max())
    raise ValueError(how)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _settings(
    temperature: float, beta: float, epsilon_low: float, epsilon_high: float | None, loss_type: str,
    use_bias_correction_kl: bool, max_completion_length: int | None, alpha: float = 0.0, eta: float = 0.5,
) -> _LossSettings:
    if loss_type not in SUPPORTED_LOSS_TYPES:
        raise ValueError(
            f"loss_type must be one of {SUPPORTED_LOSS_TYPES} (the clipped-surrogate losses), got {loss_type!r}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return _LossSettings(
        temperature=float(temperature), beta=float(beta), epsilon_low=float(epsilon_low),
        epsilon_high=None if epsilon_high is None else float(epsilon_high), loss_type=loss_type,
        use_bias_correction_kl=bool(use_bias_correction_kl), max_completion_length=max_completion_length,
        alpha=float(alpha), eta=float(eta),
    )


@torch.no_grad()
def _reference_logps(
    batch: _Batch, ref_model: torch.nn.Module | None, settings: _LossSettings, micro_batch_size: int
) -> str:
    """Fills `batch.ref_logps` when a reference model is given and the batch lacks them; returns their source."""
    if batch.ref_logps is not None:
        return "inputs"
    if ref_model is None:
        return "none"
    batch.ref_logps = _token_statistics(ref_model, batch, settings.temperature, micro_batch_size, False)["logps"]
    return "ref_model"


def _quartile_table(
    batch: _Batch,
    context: _TokenContext,
    stats: dict[str, torch.Tensor],
    settings: _LossSettings,
    quartile_grads: dict[_GradSpec, torch.Tensor] | None,
    lm_head_sigma: float,
    ref_source: str,
) -> dict[str, Any]:
    logps = stats["logps"]
    w_pg, w_kl = grpo_token_weights(
        logps, context.old_logps, batch.advantages, batch.ref_logps, settings.beta, settings.epsilon_low,
        settings.epsilon_high, settings.use_bias_correction_kl,
    )
    w = w_pg + w_kl
    nonzero_advantage = batch.advantages != 0
    clipped = nonzero_advantage & (w_pg == 0)
    probs = context.old_logps.exp()
    one_minus_p = stats["one_minus_p"]
    unit = stats["hidden_norms"]
    ratio = torch.where(one_minus_p > 0, unit / one_minus_p.clamp(min=1e-38), torch.full_like(unit, float("nan")))
    full = None
    if quartile_grads is not None:
        full = sum(quartile_grads[_GradSpec(f"q{j}")] for j in range(4))
        full_sq = _dot(full, full)
    quartiles = []
    for j in range(4):
        group = context.quartile == j
        row: dict[str, Any] = {
            "label": QUARTILE_LABELS[j],
            "count": int(group.sum()),
            "prob_min": float(probs[group].min()) if bool(group.any()) else None,
            "prob_max": float(probs[group].max()) if bool(group.any()) else None,
            "prob_mean": _stat(probs[group], "mean"),
            "abs_w_mean": _stat(w[group].abs(), "mean"),
            "abs_w_median": _stat(w[group].abs(), "median"),
            "abs_w_no_kl_mean": _stat(w_pg[group].abs(), "mean"),
            "abs_w_no_kl_median": _stat(w_pg[group].abs(), "median"),
            "abs_w_kl_part_mean": _stat(w_kl[group].abs(), "mean"),
            "zero_advantage_share": _stat(~nonzero_advantage[group], "mean"),
            "clipped_share": _stat(clipped[group & nonzero_advantage], "mean"),
            "hidden_grad_norm_mean": _stat((w.abs() * unit)[group], "mean"),
            "hidden_grad_norm_no_kl_mean": _stat((w_pg.abs() * unit)[group], "mean"),
            "unit_hidden_grad_norm_mean": _stat(unit[group], "mean"),
            "ratio_to_one_minus_p_mean": _stat(ratio[group], "mean"),
            "ratio_to_one_minus_p_max": _stat(ratio[group], "max"),
        }
        if quartile_grads is not None:
            grad = quartile_grads[_GradSpec(f"q{j}")]
            row["summed_grad_norm"] = _norm(grad)
            row["cos_with_full"] = _cosine(grad, full)
            row["contribution_to_full"] = _dot(grad, full) / full_sq if full_sq > 0 else None
        quartiles.append(row)
    report: dict[str, Any] = {
        "num_completions": batch.size,
        "num_tokens": int(context.mask.sum()),
        "quartile_edges": [float(edge) for edge in context.edges],
        "kl_reference": ref_source,
        "settings": {key: getattr(settings, key) for key in settings.__dataclass_fields__},
        "quartiles": quartiles,
        "bound": {
            "lm_head_spectral_norm": lm_head_sigma,
            "ratio_to_one_minus_p_upper_bound": math.sqrt(2.0) * lm_head_sigma / settings.temperature,
        },
    }
    if quartile_grads is not None:
        report["full_grad_norm"] = _norm(full)
        report["summed_grad_cosine"] = [
            [_cosine(quartile_grads[_GradSpec(f"q{a}")], quartile_grads[_GradSpec(f"q{b}")]) for b in range(4)]
            for a in range(4)
        ]
    lowest, highest = quartiles[0], quartiles[-1]
    report["lowest_over_highest"] = {
        key: _ratio(lowest.get(key), highest.get(key))
        for key in ("hidden_grad_norm_mean", "unit_hidden_grad_norm_mean", "summed_grad_norm", "abs_w_mean",
                    "abs_w_no_kl_mean")
    }
    return report


def measure_token_gradients(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    ref_model: torch.nn.Module | None = None,
    *,
    temperature: float = 1.0,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    use_bias_correction_kl: bool = True,
    max_completion_length: int | None = None,
    summed_gradients: bool = True,
    micro_batch_size: int = 4,
    share_prompt_forward: bool = True,
) -> dict[str, Any]:
    """
    Per probability quartile: token count, |w| with and without KL, per-token hidden-state gradient norms, and the
    norms and cosines of the quartiles' summed parameter gradients.

    Cost: one no-grad forward of `model` (plus one of `ref_model` when given and `inputs` lack
    `ref_per_token_logps`); with `summed_gradients`, one more forward with grad and four backward passes, and
    `4 x num_trainable_params` float32 of memory. All passes run over micro-batches of `micro_batch_size` completions.

    Args:
        model (`torch.nn.Module`):
            Causal LM with a linear LM head (`get_output_embeddings()`), the policy being measured.
        inputs (`dict[str, Any]`):
            A batch as produced by TRL's `GRPOTrainer._generate_and_score_completions`: `prompt_ids, prompt_mask,
            completion_ids, completion_mask, advantages` and optionally `old_per_token_logps`,
            `ref_per_token_logps`, `tool_mask`.
        ref_model (`torch.nn.Module` or `None`, *optional*):
            Reference model for the KL part when `inputs` lack `ref_per_token_logps`. Without either, the KL part is
            zero (the policy is its own reference).
        temperature (`float`, *optional*, defaults to `1.0`):
            Temperature the log-probabilities are computed with (logits / temperature), as in TRL.
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient.
        epsilon_low (`float`, *optional*, defaults to `0.2`):
            Lower clipping range.
        epsilon_high (`float` or `None`, *optional*):
            Upper clipping range; defaults to `epsilon_low`.
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Loss normalisation: `"dapo"`, `"bnpo"`, `"grpo"` or `"dr_grpo"`.
        use_bias_correction_kl (`bool`, *optional*, defaults to `True`):
            Whether the KL term is multiplied by the importance ratio (TRL's `use_bias_correction_kl`).
        max_completion_length (`int` or `None`, *optional*):
            Normaliser of `"dr_grpo"`; defaults to the batch's completion width.
        summed_gradients (`bool`, *optional*, defaults to `True`):
            Whether to compute the summed parameter gradients per quartile (the expensive part).
        micro_batch_size (`int`, *optional*, defaults to `4`):
            Completions per forward/backward pass.
        share_prompt_forward (`bool`, *optional*, defaults to `True`):
            Run a prompt shared by several completions of a micro-batch once and reuse its key/value cache (same
            result, about half the compute for long prompts; falls back to full sequences for models without a
            batch-selectable cache).

    Returns:
        `dict[str, Any]`: A JSON-serialisable report; see `run_token_diagnostics`.
    """
    return run_token_diagnostics(
        model, inputs, ref_model, temperature=temperature, beta=beta, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, loss_type=loss_type, use_bias_correction_kl=use_bias_correction_kl,
        max_completion_length=max_completion_length, summed_gradients=summed_gradients, probe_methods=(),
        micro_batch_size=micro_batch_size, share_prompt_forward=share_prompt_forward,
    )["gradients"]


def probability_shift_probe(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    ref_model: torch.nn.Module | None = None,
    *,
    methods: Sequence[str] = DEFAULT_PROBE_METHODS,
    lr: float = 1e-3,
    optimizer: str = "sgd",
    alpha: float = 0.3,
    eta: float = 0.5,
    temperature: float = 1.0,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    use_bias_correction_kl: bool = True,
    max_completion_length: int | None = None,
    micro_batch_size: int = 4,
    share_prompt_forward: bool = True,
) -> dict[str, Any]:
    """
    Applies one update per method to a copy of `model` and reports how the sampled tokens' probabilities moved.

    Methods: `"grpo"` (all tokens), `"ar"` (advantages reweighted with `alpha`), `"lopti"` (a step on the tokens with
    `pi_old < eta`, then a step on the others from the new parameters, ratio and clipping relative to `pi_old`, same
    optimizer), `"lopti_ar"` (both), `"lowest_quartile_only"` and `"highest_quartile_only"` (only Q1 or Q4 active).
    Inactive tokens get a zero advantage and a zero KL term; the loss normaliser is never changed. For each method,
    per quartile (of `pi_old`) and per advantage sign: the token count, the share of tokens whose probability moved
    in the direction of their advantage (judged on the change of log-probability), and the mean change of
    probability. Changes are measured against the model's own probabilities before the update.

    Cost: two no-grad forwards (before, plus one per method after), one forward with grad and one backward per
    distinct gradient (at most 5), plus one forward and backward per Lopti method; one model copy at a time.

    Args:
        model (`torch.nn.Module`):
            The policy; it is not modified.
        inputs (`dict[str, Any]`):
            A GRPO batch, as for `measure_token_gradients`.
        ref_model (`torch.nn.Module` or `None`, *optional*):
            Reference model for the KL term when `inputs` lack `ref_per_token_logps`.
        methods (`Sequence[str]`, *optional*):
            Methods to probe, from `PROBE_METHODS`.
        lr (`float`, *optional*, defaults to `1e-3`):
            Learning rate of the single step.
        optimizer (`str`, *optional*, defaults to `"sgd"`):
            `"sgd"` (interpretable: the update is `-lr * grad`) or `"adam"` (a fresh Adam, as at the start of
            training).
        alpha (`float`, *optional*, defaults to `0.3`):
            Advantage Reweighting strength for `"ar"` and `"lopti_ar"`.
        eta (`float`, *optional*, defaults to `0.5`):
            Lopti threshold.
        temperature (`float`, *optional*, defaults to `1.0`):
            Temperature of the log-probabilities.
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient.
        epsilon_low (`float`, *optional*, defaults to `0.2`):
            Lower clipping range.
        epsilon_high (`float` or `None`, *optional*):
            Upper clipping range; defaults to `epsilon_low`.
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Loss normalisation.
        use_bias_correction_kl (`bool`, *optional*, defaults to `True`):
            Whether the KL term is multiplied by the importance ratio.
        max_completion_length (`int` or `None`, *optional*):
            Normaliser of `"dr_grpo"`.
        micro_batch_size (`int`, *optional*, defaults to `4`):
            Completions per forward/backward pass.
        share_prompt_forward (`bool`, *optional*, defaults to `True`):
            Run a prompt shared by several completions of a micro-batch once and reuse its key/value cache (same
            result, about half the compute for long prompts; falls back to full sequences for models without a
            batch-selectable cache).

    Returns:
        `dict[str, Any]`: The `"probe"` part of `run_token_diagnostics`'s report.
    """
    return run_token_diagnostics(
        model, inputs, ref_model, temperature=temperature, beta=beta, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, loss_type=loss_type, use_bias_correction_kl=use_bias_correction_kl,
        max_completion_length=max_completion_length, summed_gradients=False, probe_methods=methods, lr=lr,
        optimizer=optimizer, alpha=alpha, eta=eta, micro_batch_size=micro_batch_size,
        share_prompt_forward=share_prompt_forward,
    )["probe"]


def _probe_specs(method: str) -> tuple[_GradSpec, _GradSpec | None]:
    """First-step gradient at the starting parameters, and the second step's for the Lopti methods."""
    advantages = "AR" if method in ("ar", "lopti_ar") else "A"
    if method in ("grpo", "ar"):
        return _GradSpec("all", advantages), None
    if method in ("lopti", "lopti_ar"):
        return _GradSpec("low", advantages), _GradSpec("high", advantages)
    if method == "lowest_quartile_only":
        return _GradSpec("q0"), None
    if method == "highest_quartile_only":
        return _GradSpec("q3"), None
    raise ValueError(f"unknown probe method {method!r}; choose from {PROBE_METHODS}")


def _resolve_gradient(spec: _GradSpec, grads: dict[_GradSpec, torch.Tensor]) -> torch.Tensor:
    if spec in grads:
        return grads[spec]
    if spec.tokens == "all":  # the quartiles partition the completion tokens, so their gradients sum to the full one
        return sum(grads[_GradSpec(f"q{j}", spec.advantages)] for j in range(4))
    raise KeyError(spec)


def _apply_flat_gradient(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, flat: torch.Tensor):
    offset = 0
    for param in params:
        size = param.numel()
        param.grad = flat[offset : offset + size].view_as(param).to(param.dtype).clone()
        offset += size
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _make_optimizer(params: list[torch.nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {name!r}")


def _shift_table(
    context: _TokenContext, advantages: torch.Tensor, logps_before: torch.Tensor, logps_after: torch.Tensor
) -> dict[str, Any]:
    delta_logp = (logps_after - logps_before).double()
    delta_p = logps_before.double().exp() * torch.expm1(delta_logp)
    groups = [("all", context.mask)] + [(f"q{j}", context.quartile == j) for j in range(4)]
    table: dict[str, Any] = {}
    for name, group in groups:
        entry: dict[str, Any] = {"label": "all" if name == "all" else QUARTILE_LABELS[int(name[1:])]}
        for sign, selector, direction in (("positive", advantages > 0, 1.0), ("negative", advantages < 0, -1.0)):
            tokens = group & selector
            count = int(tokens.sum())
            entry[sign] = {
                "count": count,
                "share_in_direction": float((delta_logp[tokens] * direction > 0).double().mean()) if count else None,
                "mean_delta_prob": float(delta_p[tokens].double().mean()) if count else None,
                "mean_delta_logp": float(delta_logp[tokens].double().mean()) if count else None,
            }
        entry["zero_advantage_count"] = int((group & (advantages == 0)).sum())
        table[name] = entry
    return table


def run_token_diagnostics(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    ref_model: torch.nn.Module | None = None,
    *,
    temperature: float = 1.0,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    use_bias_correction_kl: bool = True,
    max_completion_length: int | None = None,
    summed_gradients: bool = True,
    probe_methods: Sequence[str] = DEFAULT_PROBE_METHODS,
    lr: float = 1e-3,
    optimizer: str = "sgd",
    alpha: float = 0.3,
    eta: float = 0.5,
    micro_batch_size: int = 4,
    share_prompt_forward: bool = True,
) -> dict[str, Any]:
    """
    Runs the quartile measurements and the probability-shift probe on one batch, sharing their gradients.

    The gradients at the starting parameters (the four quartiles' and those the probe needs) come from a single
    forward with grad per micro-batch followed by one backward per distinct gradient; the GRPO, lowest-only and
    highest-only updates reuse the quartile gradients (they are their sum, Q1 and Q4). Memory beyond the model: one
    flat float32 buffer of the trainable parameters per distinct gradient (4 quartiles, plus AR and the Lopti low
    pass when probed), one model copy with its optimizer state during the probe, and the activations of one
    micro-batch.

    Args:
        model (`torch.nn.Module`):
            The policy: a causal LM with a linear LM head. It is not modified (the probe updates copies).
        inputs (`dict[str, Any]`):
            A GRPO batch (see `measure_token_gradients`).
        ref_model (`torch.nn.Module` or `None`, *optional*):
            Reference model for the KL part when `inputs` lack `ref_per_token_logps`.
        temperature (`float`, *optional*, defaults to `1.0`):
            Temperature of the log-probabilities.
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient.
        epsilon_low (`float`, *optional*, defaults to `0.2`):
            Lower clipping range.
        epsilon_high (`float` or `None`, *optional*):
            Upper clipping range; defaults to `epsilon_low`.
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Loss normalisation: `"dapo"`, `"bnpo"`, `"grpo"` or `"dr_grpo"`.
        use_bias_correction_kl (`bool`, *optional*, defaults to `True`):
            Whether the KL term is multiplied by the importance ratio.
        max_completion_length (`int` or `None`, *optional*):
            Normaliser of `"dr_grpo"`.
        summed_gradients (`bool`, *optional*, defaults to `True`):
            Whether to compute the per-quartile summed parameter gradients.
        probe_methods (`Sequence[str]`, *optional*):
            Methods for the probability-shift probe (see `probability_shift_probe`); empty to skip the probe.
        lr (`float`, *optional*, defaults to `1e-3`):
            Probe learning rate.
        optimizer (`str`, *optional*, defaults to `"sgd"`):
            Probe optimizer, `"sgd"` or `"adam"`.
        alpha (`float`, *optional*, defaults to `0.3`):
            Advantage Reweighting strength of the probe's AR methods.
        eta (`float`, *optional*, defaults to `0.5`):
            Lopti threshold of the probe's Lopti methods.
        micro_batch_size (`int`, *optional*, defaults to `4`):
            Completions per forward/backward pass.
        share_prompt_forward (`bool`, *optional*, defaults to `True`):
            Run a prompt shared by several completions of a micro-batch once and reuse its key/value cache (same
            result, about half the compute for long prompts; falls back to full sequences for models without a
            batch-selectable cache).

    Returns:
        `dict[str, Any]`: `{"gradients": ..., "probe": ... or None, "timing_s": ...}`. `gradients` holds
        `quartile_edges`, `quartiles` (one row per quartile: `count`, `abs_w_mean/median` with KL,
        `abs_w_no_kl_mean/median`, `abs_w_kl_part_mean`, `zero_advantage_share`, `clipped_share` (of the tokens
        with a non-zero advantage), `hidden_grad_norm_mean` (`|w| * ||dlogpi/dh||`), `unit_hidden_grad_norm_mean`,
        `ratio_to_one_minus_p_mean/max`, and with summed gradients `summed_grad_norm`, `cos_with_full`,
        `contribution_to_full`), `summed_grad_cosine` (4 x 4), `full_grad_norm`, `bound` and `lowest_over_highest`.
    """
    for method in probe_methods:
        _probe_specs(method)
    settings = _settings(temperature, beta, epsilon_low, epsilon_high, loss_type, use_bias_correction_kl,
                         max_completion_length, alpha, eta)
    device = _model_device(model)
    batch = _batch_from_inputs(inputs, device)
    batch.share_prompts = share_prompt_forward
    timing: dict[str, float] = {}
    was_training = model.training
    model.eval()
    try:
        start = time.perf_counter()
        ref_source = _reference_logps(batch, ref_model, settings, micro_batch_size)
        stats = _token_statistics(model, batch, settings.temperature, micro_batch_size, hidden_norms=True)
        context = _TokenContext(batch, stats["logps"], settings)
        sigma = lm_head_spectral_norm(_lm_head_weight(model))
        timing["token_statistics"] = time.perf_counter() - start
        logger.info("token statistics of %d tokens in %.1f s", int(context.mask.sum()), timing["token_statistics"])

        specs: list[_GradSpec] = [_GradSpec(f"q{j}") for j in range(4)] if summed_gradients else []
        for method in probe_methods:
            first, _ = _probe_specs(method)
            if first not in specs and not (first.tokens == "all" and first.advantages == "A" and summed_gradients):
                specs.append(first)
        start = time.perf_counter()
        grads = _weighted_gradients(model, batch, context, specs, settings, micro_batch_size)
        timing["gradients"] = time.perf_counter() - start
        logger.info("%d summed gradients in %.1f s", len(specs), timing["gradients"])

        report = {
            "gradients": _quartile_table(
                batch, context, stats, settings, grads if summed_gradients else None, sigma, ref_source
            ),
            "probe": None,
        }
        if probe_methods:
            start = time.perf_counter()
            report["probe"] = _run_probe(model, batch, context, stats["logps"], grads, settings, probe_methods,
                                         lr, optimizer, micro_batch_size)
            timing["probe"] = time.perf_counter() - start
    finally:
        model.train(was_training)
    report["timing_s"] = timing
    return _json_safe(report)


def _run_probe(
    model: torch.nn.Module,
    batch: _Batch,
    context: _TokenContext,
    logps_before: torch.Tensor,
    grads: dict[_GradSpec, torch.Tensor],
    settings: _LossSettings,
    methods: Sequence[str],
    lr: float,
    optimizer_name: str,
    micro_batch_size: int,
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    sign_counts = {
        "positive": int((context.mask & (batch.advantages > 0)).sum()),
        "negative": int((context.mask & (batch.advantages < 0)).sum()),
    }
    for method in methods:
        first, second = _probe_specs(method)
        updated = copy.deepcopy(model)
        updated.eval()
        params = _trainable_parameters(updated)
        optimizer = _make_optimizer(params, optimizer_name, lr)
        start_vector = torch.cat([param.detach().reshape(-1).float() for param in params])
        _apply_flat_gradient(params, optimizer, _resolve_gradient(first, grads))
        if second is not None:  # Lopti: the high tokens from the new parameters, ratio and clipping against pi_old
            second_grad = _weighted_gradients(updated, batch, context, [second], settings, micro_batch_size)[second]
            _apply_flat_gradient(params, optimizer, second_grad)
            del second_grad
        step = torch.cat([param.detach().reshape(-1).float() for param in params]) - start_vector
        update_norm = _norm(step)
        del step
        logps_after = _token_statistics(updated, batch, settings.temperature, micro_batch_size, False)["logps"]
        results[method] = {
            "update_norm": update_norm,
            "groups": _shift_table(context, batch.advantages, logps_before, logps_after),
        }
        del updated, optimizer, params, start_vector
        logger.info("probe %s done", method)
    return {
        "optimizer": optimizer_name,
        "lr": lr,
        "alpha": settings.alpha,
        "eta": settings.eta,
        "token_counts": sign_counts,
        "low_token_count": int(context.low.sum()),
        "methods": results,
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, torch.Tensor):
        return _json_safe(value.tolist())
    return value


def flatten_report(report: dict[str, Any], prefix: str = "diagnostics/") -> dict[str, float]:
    """
    Flattens the `gradients` part of a report (or a report from `measure_token_gradients`) into scalar metrics.

    Args:
        report (`dict[str, Any]`):
            Output of `measure_token_gradients` or `run_token_diagnostics`.
        prefix (`str`, *optional*, defaults to `"diagnostics/"`):
            Prefix of every key.

    Returns:
        `dict[str, float]`: Keys such as `diagnostics/abs_w_mean_q1`,
        `diagnostics/lowest_over_highest/summed_grad_norm`,
        `diagnostics/quartile_edge_1`; `None` values are left out.
    """
    gradients = report.get("gradients", report)
    flat: dict[str, float] = {}
    for j, row in enumerate(gradients.get("quartiles", []), start=1):
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"{prefix}{key}_q{j}"] = float(value)
    for j, edge in enumerate(gradients.get("quartile_edges", []), start=1):
        if edge is not None:
            flat[f"{prefix}quartile_edge_{j}"] = float(edge)
    for key, value in gradients.get("lowest_over_highest", {}).items():
        if value is not None:
            flat[f"{prefix}lowest_over_highest/{key}"] = float(value)
    if gradients.get("full_grad_norm") is not None:
        flat[f"{prefix}full_grad_norm"] = float(gradients["full_grad_norm"])
    return flat


# ---------------------------------------------------------------------------------------------------------------------
# Callback
# ---------------------------------------------------------------------------------------------------------------------


class TokenDiagnosticsCallback(TrainerCallback):
    """
    Logs per-probability-quartile token diagnostics under `diagnostics/` every `every_n_steps` optimizer steps.

    At the end of every `every_n_steps`-th optimizer step, it takes one buffered micro-batch of the trainer
    (`trainer._buffered_inputs[micro_batch_index]`, the completions of the current generation batch with their
    advantages and, when TRL computed them, old and reference log-probabilities) and runs `measure_token_gradients`
    on it with the trainer's temperature, beta, clipping and loss type. Values are added to the trainer's metrics, so
    they are averaged and logged at the next logging step next to TRL's own (W&B, TensorBoard, trackio, ...). Keys:
    `diagnostics/<metric>_q<j>` (j = 1 lowest ... 4 highest), `diagnostics/quartile_edge_<j>`,
    `diagnostics/lowest_over_highest/<metric>`.

    Cost per measured step (no cost on the other steps): one no-grad forward of the policy over the micro-batch
    (`per_device_train_batch_size` completions), i.e. about a third of that micro-batch's training forward+backward,
    plus a `(tokens x vocab) @ (vocab x hidden)` product for the closed-form hidden-state gradients (the size of the
    LM head's forward); plus one no-grad forward of `ref_model` if one is passed and the batch lacks reference
    log-probabilities. With `summed_gradients=True` add one forward with grad and four backward passes (about two
    training micro-steps) and `4 x num_trainable_params` float32 of memory. The measurement runs in eval mode under
    the current parameters (after the step's update), so the ratio `pi / pi_old` can differ from one. Loss types other
    than `dapo`, `bnpo`, `grpo` and `dr_grpo` are measured with the clipped-surrogate weights and `dapo` normalisation.

    Args:
        trainer (`trl.GRPOTrainer`):
            The trainer to measure (a `LoptiGRPOTrainer` works the same way).
        every_n_steps (`int`, *optional*, defaults to `50`):
            Measure every this many optimizer steps.
        summed_gradients (`bool`, *optional*, defaults to `False`):
            Also compute the per-quartile summed parameter gradients (expensive, see above).
        micro_batch_index (`int`, *optional*, defaults to `0`):
            Which buffered micro-batch to measure.
        micro_batch_size (`int`, *optional*, defaults to `4`):
            Completions per forward pass of the measurement.
        ref_model (`torch.nn.Module` or `None`, *optional*):
            Reference model, when the batch has no `ref_per_token_logps` (TRL adds them whenever `beta > 0`).
    """

    def __init__(
        self,
        trainer: Any,
        every_n_steps: int = 50,
        summed_gradients: bool = False,
        micro_batch_index: int = 0,
        micro_batch_size: int = 4,
        ref_model: torch.nn.Module | None = None,
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.trainer = trainer
        self.every_n_steps = every_n_steps
        self.summed_gradients = summed_gradients
        self.micro_batch_index = micro_batch_index
        self.micro_batch_size = micro_batch_size
        self.ref_model = ref_model
        self.last_report: dict[str, Any] | None = None

    def measure(self) -> dict[str, float]:
        """
        Measures the current buffered micro-batch now and returns the flat metrics (also stored in `last_report`).

        Returns:
            `dict[str, float]`: The metrics, keys prefixed with `diagnostics/`; empty when nothing is buffered.
        """
        trainer = self.trainer
        buffered = getattr(trainer, "_buffered_inputs", None)
        if not buffered:
            return {}
        inputs = buffered[min(self.micro_batch_index, len(buffered) - 1)]
        model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        args = trainer.args
        loss_type = getattr(trainer, "loss_type", getattr(args, "loss_type", "dapo"))
        if loss_type not in SUPPORTED_LOSS_TYPES:
            loss_type = "dapo"  # the weights and normalisation of the clipped surrogate; ratios are unaffected
        report = measure_token_gradients(
            model,
            inputs,
            self.ref_model,
            temperature=getattr(trainer, "temperature", getattr(args, "temperature", 1.0)),
            beta=getattr(trainer, "beta", getattr(args, "beta", 0.0)),
            epsilon_low=getattr(trainer, "epsilon_low", getattr(args, "epsilon", 0.2)),
            epsilon_high=getattr(trainer, "epsilon_high", None),
            loss_type=loss_type,
            use_bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", True)),
            max_completion_length=getattr(args, "max_completion_length", None),
            summed_gradients=self.summed_gradients,
            micro_batch_size=self.micro_batch_size,
        )
        self.last_report = report
        return flatten_report(report)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_n_steps != 0:
            return control
        metrics = self.measure()
        if not metrics:
            return control
        store = getattr(self.trainer, "_metrics", None)
        if isinstance(store, dict) and "train" in store:
            for key, value in metrics.items():
                store["train"][key].append(value)
        else:
            self.trainer.log(metrics)
        return control


# ---------------------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------------------


def plot_report(report: dict[str, Any], output_dir: str | os.PathLike) -> list[str]:
    """
    Writes bar charts by probability quartile (as in the paper's Fig. 1 and Fig. 3) for a `run_token_diagnostics`
    report.

    Args:
        report (`dict[str, Any]`):
            Output of `run_token_diagnostics`.
        output_dir (`str` or `os.PathLike`):
            Folder for the PNG files.

    Returns:
        `list[str]`: Paths of the files written: `gradients.png`, and `probability_shift.png` when the report has a
        probe.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    gradients = report["gradients"]
    rows = gradients["quartiles"]
    labels = [f"{row['label']}\n(n={row['count']})" for row in rows]
    positions = list(range(len(rows)))

    def values(key: str) -> list[float]:
        return [row.get(key) if row.get(key) is not None else 0.0 for row in rows]

    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.4
    axes[0, 0].bar([p - width / 2 for p in positions], values("abs_w_mean"), width, label="with KL")
    axes[0, 0].bar([p + width / 2 for p in positions], values("abs_w_no_kl_mean"), width, label="without KL")
    axes[0, 0].set_title("mean |w| per token")
    axes[0, 0].legend()
    axes[0, 1].bar(positions, values("hidden_grad_norm_mean"))
    axes[0, 1].set_title("mean per-token ||dL_t/dh_t|| (last hidden state)")
    axes[1, 0].bar(positions, values("ratio_to_one_minus_p_mean"), label="mean")
    axes[1, 0].plot(positions, values("ratio_to_one_minus_p_max"), "k^", label="max")
    bound = gradients["bound"]["ratio_to_one_minus_p_upper_bound"]
    if bound is not None:
        axes[1, 0].axhline(bound, color="r", linestyle="--", label="bound sqrt(2)·σmax(W)/T")
    axes[1, 0].set_title("||dlogπ_t/dh_t|| / (1 - π_t)")
    axes[1, 0].set_yscale("log")  # the bound is loose: it is often orders of magnitude above the measured ratio
    axes[1, 0].legend(fontsize=8)
    if rows and "summed_grad_norm" in rows[0]:
        axes[1, 1].bar(positions, values("summed_grad_norm"), 0.6, label="||Σ grad||")
        twin = axes[1, 1].twinx()
        twin.plot(positions, values("cos_with_full"), "ko-", label="cos with full")
        twin.set_ylim(-1, 1)
        twin.set_ylabel("cosine with full gradient")
        axes[1, 1].set_title("summed parameter gradient per quartile")
        axes[1, 1].legend(loc="lower left", fontsize=8)
        twin.legend(loc="lower right", fontsize=8)
    else:
        axes[1, 1].set_axis_off()
    edges = ", ".join(f"{edge:.3g}" for edge in gradients["quartile_edges"] if edge is not None)
    for axis in axes.flat:
        if axis.axison:
            axis.set_xticks(positions)
            axis.set_xticklabels(labels, fontsize=8)
    figure.suptitle(f"Token diagnostics by π_old quartile (edges {edges})")
    figure.subplots_adjust(left=0.06, right=0.94, bottom=0.08, top=0.9, hspace=0.4, wspace=0.3)
    path = output_dir / "gradients.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    written.append(str(path))

    probe = report.get("probe")
    if probe and probe.get("methods"):
        methods = list(probe["methods"])
        figure, axes = plt.subplots(2, 2, figsize=(13, 8))
        width = 0.8 / len(methods)
        for col, sign in enumerate(_PROBE_SIGNS):
            for index, method in enumerate(methods):
                groups = probe["methods"][method]["groups"]
                shares = [groups[f"q{j}"][sign]["share_in_direction"] for j in range(4)]
                deltas = [groups[f"q{j}"][sign]["mean_delta_prob"] for j in range(4)]
                offsets = [p - 0.4 + width * (index + 0.5) for p in positions]
                axes[0, col].bar(offsets, [s if s is not None else 0.0 for s in shares], width, label=method)
                axes[1, col].bar(offsets, [d if d is not None else 0.0 for d in deltas], width, label=method)
            axes[0, col].set_title(f"share of {sign}-advantage tokens moved in their direction")
            axes[0, col].set_ylim(0, 1)
            axes[1, col].set_title(f"mean Δπ of {sign}-advantage tokens")
            for row in range(2):
                axes[row, col].set_xticks(positions)
                axes[row, col].set_xticklabels(QUARTILE_LABELS, fontsize=8)
        axes[0, 0].legend(fontsize=8)
        figure.suptitle(
            f"One {probe['optimizer']} step (lr={probe['lr']:g}, α={probe['alpha']:g}, η={probe['eta']:g})"
        )
        figure.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.9, hspace=0.35, wspace=0.2)
        path = output_dir / "probability_shift.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(str(path))
    return written


def format_tables(report: dict[str, Any]) -> str:
    """
    Renders the main numbers of a `run_token_diagnostics` report as Markdown tables.

    Args:
        report (`dict[str, Any]`):
            Output of `run_token_diagnostics`.

    Returns:
        `str`: Markdown text.
    """

    def fmt(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    gradients = report["gradients"]
    lines = []
    if report.get("inner_steps"):
        inner = report["inner_steps"]
        lines += [f"Measured after {inner['steps']} Adam step(s) (lr {fmt(inner['lr'])}, ‖Δθ‖ "
                  f"{fmt(inner['update_norm'])}) of GRPO on the batch; reference and π_old = the sampling model.", ""]
    lines += [
        f"Tokens: {gradients['num_tokens']} in {gradients['num_completions']} completions; quartile edges of π_old: "
        + ", ".join(fmt(edge) for edge in gradients["quartile_edges"]),
        "",
        "| quartile | n | mean π | mean |w| (KL) | median |w| (KL) | mean |w| (no KL) | median |w| (no KL) "
        "| mean ‖dL_t/dh‖ | mean ‖dlogπ/dh‖/(1-π) | max ratio | ‖Σ grad‖ | cos(full) | share of full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in gradients["quartiles"]:
        lines.append("| " + " | ".join(fmt(row.get(key)) for key in (
            "label", "count", "prob_mean", "abs_w_mean", "abs_w_median", "abs_w_no_kl_mean", "abs_w_no_kl_median",
            "hidden_grad_norm_mean", "ratio_to_one_minus_p_mean", "ratio_to_one_minus_p_max", "summed_grad_norm",
            "cos_with_full", "contribution_to_full")) + " |")
    lines.append("")
    lines.append(f"Bound on ‖dlogπ/dh‖/(1-π): {fmt(gradients['bound']['ratio_to_one_minus_p_upper_bound'])}; "
                 f"KL reference: {gradients['kl_reference']}")
    lines.append("Lowest/highest quartile: " + ", ".join(
        f"{key} {fmt(value)}" for key, value in gradients["lowest_over_highest"].items()))
    if gradients.get("summed_grad_cosine"):
        lines += ["", "Cosine between quartiles' summed gradients:", "", "| | Q1 | Q2 | Q3 | Q4 |",
                  "|---|---|---|---|---|"]
        for j, row in enumerate(gradients["summed_grad_cosine"]):
            lines.append(f"| Q{j + 1} | " + " | ".join(fmt(value) for value in row) + " |")
    probe = report.get("probe")
    if probe and probe.get("methods"):
        lines += ["", f"Probability shift after one {probe['optimizer']} step (lr {fmt(probe['lr'])}, alpha "
                      f"{fmt(probe['alpha'])}, eta {fmt(probe['eta'])}): share moved in the direction of the "
                      "advantage (mean Δπ)", ""]
        for sign in _PROBE_SIGNS:
            lines += [f"{sign} advantages ({probe['token_counts'][sign]} tokens):", "",
                      "| method | all | Q1 | Q2 | Q3 | Q4 | ‖Δθ‖ |", "|---|---|---|---|---|---|---|"]
            for method, result in probe["methods"].items():
                cells = []
                for group in ("all", "q0", "q1", "q2", "q3"):
                    entry = result["groups"][group][sign]
                    cells.append(f"{fmt(entry['share_in_direction'])} ({fmt(entry['mean_delta_prob'])})")
                lines.append(f"| {method} | " + " | ".join(cells) + f" | {fmt(result['update_norm'])} |")
            lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Command line: trl-lopti diagnose
# ---------------------------------------------------------------------------------------------------------------------


_TOY_PROMPTS = [
    "Write one short sentence about the sea.",
    "Name three colours.",
    "Count from one to five.",
    "Say hello in a friendly way.",
    "Describe a cat in a few words.",
    "What is two plus two?",
    "List some fruits.",
    "Give me a word that rhymes with cat.",
]


def _toy_reward(completions: list[Any], **kwargs) -> list[float]:
    """Reward of `--task toy`: the share of letters among the completion's characters (varies on any model)."""
    texts = [_completion_text(completion) for completion in completions]
    return [sum(char.isalpha() for char in text) / max(1, len(text)) for text in texts]


def _constant_reward(completions: list[Any], **kwargs) -> list[float]:
    """Reward 1.0 for every completion: all advantages are zero."""
    return [1.0 for _ in completions]


def _length_reward(completions: list[Any], **kwargs) -> list[float]:
    """Reward equal to the completion's length in characters."""
    return [float(len(_completion_text(completion))) for completion in completions]


def _kk_partial_reward(completions: list[Any], solution_text_format: list[str], **kwargs) -> list[float]:
    """Partial credit on Knights & Knaves for models too weak for the paper's all-or-nothing reward: the paper's reward
    plus, per person, +1/n when the response states "<name> is a <correct role>" (last statement) and -1/n when it
    states the wrong role. Only for diagnostics: it gives rewards that differ within a group of a small model."""
    import re

    from .tasks.knights_knaves import knights_knaves_reward, parse_solution_text_format

    base = knights_knaves_reward(completions, solution_text_format, **kwargs)
    rewards = []
    for index, (completion, truth) in enumerate(zip(completions, solution_text_format)):
        text = _completion_text(completion)
        roles = parse_solution_text_format(truth)
        bonus = 0.0
        for name, role in roles.items():
            said = re.findall(rf"\b{re.escape(name)}\b\s+is\s+a\s+(knight|knave)\b", text, re.IGNORECASE)
            if said:
                bonus += (1.0 if said[-1].lower() == role else -1.0) / len(roles)
        rewards.append(base[index] + bonus)
    return rewards


_BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "constant": _constant_reward,
    "kk_partial": _kk_partial_reward,
    "length": _length_reward,
    "toy": _toy_reward,
}


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def _load_task(
    task: str, num_prompts: int, num_people: int, seed: int
) -> tuple[list[Any], list[dict[str, Any]], Callable]:
    """Prompts (conversational or plain), per-prompt extra columns, and the reward function of a task."""
    if task == "knights_knaves":
        try:
            from .tasks import knights_knaves
        except ImportError as error:
            raise SystemExit(f"--task knights_knaves needs trl_lopti.tasks.knights_knaves: {error}") from error
        dataset = knights_knaves.generate_dataset(num_people=num_people, num_samples=num_prompts, seed=seed)
        rows = [dataset[index] for index in range(min(num_prompts, len(dataset)))]
        prompts = [row["prompt"] for row in rows]
        extras = [{key: value for key, value in row.items() if key != "prompt"} for row in rows]
        return prompts, extras, knights_knaves.knights_knaves_reward
    if task == "toy":
        prompts = [
            [{"role": "user", "content": _TOY_PROMPTS[index % len(_TOY_PROMPTS)]}] for index in range(num_prompts)
        ]
        return prompts, [{} for _ in prompts], _toy_reward
    raise SystemExit(f"unknown --task {task!r}; choose knights_knaves or toy")


def _resolve_model_path(name_or_path: str) -> str:
    if name_or_path.lower() in ("smollm2", "smollm2-135m-instruct") and not Path(name_or_path).exists():
        try:
            from . import smollm2
        except ImportError as error:
            raise SystemExit(f"--model_name_or_path {name_or_path} needs trl_lopti.smollm2: {error}") from error
        for attribute in ("get_smollm2", "smollm2_path", "get_smollm2_path"):
            if hasattr(smollm2, attribute):
                return str(getattr(smollm2, attribute)())
        raise SystemExit("trl_lopti.smollm2 has no function returning the model path")
    return name_or_path


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """
    Group-normalised advantages as TRL's `GRPOTrainer` computes them: `(r - group mean) / (group std + 1e-4)`.

    Groups whose rewards are all equal get zero advantages (never NaN), also with `num_generations=1`.

    Args:
        rewards (`torch.Tensor`):
            Rewards, shape (num_prompts * num_generations,), the generations of a prompt contiguous.
        num_generations (`int`):
            Completions per prompt.
        scale_rewards (`str`, *optional*, defaults to `"group"`):
            `"group"` (divide by the group's std), `"batch"` (by the batch's std) or `"none"`.

    Returns:
        `torch.Tensor`: Advantages, same shape as `rewards`.
    """
    grouped = rewards.float().view(-1, num_generations)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "group":
        std = grouped.std(dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(grouped[:, :1])
        std = std.expand_as(grouped).reshape(-1)
    elif scale_rewards == "batch":
        std = rewards.float().std().expand_as(advantages) if rewards.numel() > 1 else torch.zeros_like(advantages)
    elif scale_rewards == "none":
        return advantages
    else:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    return advantages / (torch.nan_to_num(std, nan=0.0) + 1e-4)


def _prompt_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The chat template as TRL applies it: a final assistant message (e.g. a pre-filled `<think>`) is continued."""
    continue_final = messages[-1]["role"] == "assistant"
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=not continue_final, continue_final_message=continue_final
    )


@torch.no_grad()
def generate_grpo_batch(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[Any],
    extras: list[dict[str, Any]],
    reward_func: Callable[..., list[float]],
    *,
    num_generations: int,
    max_completion_length: int,
    temperature: float,
    generation_batch_size: int = 16,
    scale_rewards: str = "group",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """
    Samples completions and builds a GRPO batch in the format of TRL's `GRPOTrainer` (left-padded prompts, completion
    mask up to and including the first EOS, group-normalised advantages).

    Args:
        model (`torch.nn.Module`):
            The policy.
        tokenizer (`Any`):
            Its tokenizer (with a chat template when the prompts are conversational).
        prompts (`list[Any]`):
            Prompts: strings or lists of chat messages.
        extras (`list[dict[str, Any]]`):
            Per-prompt extra columns passed to the reward function (as TRL passes dataset columns).
        reward_func (`Callable[..., list[float]]`):
            TRL-style reward function `f(prompts, completions, completion_ids, **columns) -> list[float]`.
        num_generations (`int`):
            Completions per prompt.
        max_completion_length (`int`):
            Maximum new tokens.
        temperature (`float`):
            Sampling temperature (top-p 1, no top-k, as TRL's defaults).
        generation_batch_size (`int`, *optional*, defaults to `16`):
            Sequences per `generate` call.
        scale_rewards (`str`, *optional*, defaults to `"group"`):
            Advantage scaling, see `group_advantages`.

    Returns:
        `tuple[dict[str, Any], dict[str, Any]]`: The `inputs` dict and a summary (rewards, lengths, texts).
    """
    device = _model_device(model)
    conversational = isinstance(prompts[0], list)
    texts = [_prompt_text(tokenizer, prompt) if conversational else prompt for prompt in prompts]
    repeated = [index for index in range(len(prompts)) for _ in range(num_generations)]
    eos_ids = tokenizer.eos_token_id if isinstance(tokenizer.eos_token_id, list) else [tokenizer.eos_token_id]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.eos_token_id is not None:
        extra = generation_config.eos_token_id
        eos_ids = sorted(set(eos_ids) | set(extra if isinstance(extra, list) else [extra]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    encoded = tokenizer([texts[index] for index in repeated], return_tensors="pt", padding=True,
                        add_special_tokens=False)
    tokenizer.padding_side = padding_side
    prompt_ids, prompt_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    chunks = []
    for start in range(0, prompt_ids.size(0), generation_batch_size):
        rows = slice(start, start + generation_batch_size)
        output = model.generate(
            input_ids=prompt_ids[rows], attention_mask=prompt_mask[rows], do_sample=True, temperature=temperature,
            top_p=1.0, top_k=0, max_new_tokens=max_completion_length, pad_token_id=pad_id, eos_token_id=eos_ids,
        )
        completion = output[:, prompt_ids.size(1):]
        padding = (0, max_completion_length - completion.size(1))
        chunks.append(torch.nn.functional.pad(completion, padding, value=pad_id))
    completion_ids = torch.cat(chunks, dim=0)
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=device))
    eos_index = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
    eos_index[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    completion_mask = (torch.arange(is_eos.size(1), device=device).expand_as(is_eos) <= eos_index.unsqueeze(1)).long()
    completion_texts = [
        tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        for ids, mask in zip(completion_ids, completion_mask)
    ]
    completions = (
        [[{"role": "assistant", "content": text}] for text in completion_texts] if conversational else completion_texts
    )
    columns = {key: [extras[index][key] for index in repeated] for key in (extras[0] if extras else {})}
    rewards = reward_func(
        prompts=[prompts[index] for index in repeated], completions=completions,
        completion_ids=[ids[mask.bool()].tolist() for ids, mask in zip(completion_ids, completion_mask)], **columns,
    )
    rewards = torch.tensor([math.nan if value is None else float(value) for value in rewards], dtype=torch.float32)
    rewards = torch.nan_to_num(rewards, nan=0.0)
    advantages = group_advantages(rewards, num_generations, scale_rewards).to(device)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
    }
    summary = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rewards": rewards.tolist(),
        "completion_length_mean": float(completion_mask.sum(1).float().mean()),
        "prompt_length_max": int(prompt_mask.sum(1).max()),
        "num_completions": int(completion_ids.size(0)),
        "num_zero_advantage_completions": int((advantages == 0).sum()),
        "sample_completions": completion_texts[: min(3, len(completion_texts))],
    }
    return inputs, summary


def advance_policy_on_batch(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    steps: int,
    lr: float,
    *,
    temperature: float = 1.0,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    use_bias_correction_kl: bool = True,
    micro_batch_size: int = 4,
) -> dict[str, Any]:
    """
    Takes `steps` Adam steps of the GRPO loss on one batch, as TRL does with `num_iterations = steps + 1`, so that the
    diagnostics can be measured at a policy that has moved away from the one that sampled the batch.

    Before the first step, the batch's log-probabilities under the current model are stored as
    `old_per_token_logps` (the behaviour policy) and, when `beta > 0`, as `ref_per_token_logps` (the reference is the
    model that sampled the batch, as at the start of training). The steps use the full clipped loss with the KL term.
    Afterwards the importance ratios differ from one, some tokens are clipped and the KL part of `w` is non-zero.

    Args:
        model (`torch.nn.Module`):
            The policy; updated in place.
        inputs (`dict[str, Any]`):
            A GRPO batch; `old_per_token_logps` (and `ref_per_token_logps`) are added in place.
        steps (`int`):
            Number of optimizer steps.
        lr (`float`):
            Adam learning rate.
        temperature (`float`, *optional*, defaults to `1.0`):
            Temperature of the log-probabilities.
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient.
        epsilon_low (`float`, *optional*, defaults to `0.2`):
            Lower clipping range.
        epsilon_high (`float` or `None`, *optional*):
            Upper clipping range; defaults to `epsilon_low`.
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Loss normalisation.
        use_bias_correction_kl (`bool`, *optional*, defaults to `True`):
            Whether the KL term is multiplied by the importance ratio.
        micro_batch_size (`int`, *optional*, defaults to `4`):
            Completions per forward/backward pass.

    Returns:
        `dict[str, Any]`: `{"steps", "lr", "update_norm"}`.
    """
    settings = _settings(temperature, beta, epsilon_low, epsilon_high, loss_type, use_bias_correction_kl, None)
    batch = _batch_from_inputs(inputs, _model_device(model))
    was_training = model.training
    model.eval()
    try:
        logps = _token_statistics(model, batch, settings.temperature, micro_batch_size, False)["logps"].float()
        inputs["old_per_token_logps"] = logps
        batch.old_logps = logps
        if beta != 0.0:
            inputs["ref_per_token_logps"] = logps.clone()
            batch.ref_logps = inputs["ref_per_token_logps"]
        context = _TokenContext(batch, logps, settings)
        params = _trainable_parameters(model)
        start_vector = torch.cat([param.detach().reshape(-1).float() for param in params])
        optimizer = _make_optimizer(params, "adam", lr)
        spec = _GradSpec("all")
        for step in range(steps):
            grad = _weighted_gradients(model, batch, context, [spec], settings, micro_batch_size)[spec]
            _apply_flat_gradient(params, optimizer, grad)
            logger.info("inner step %d/%d done", step + 1, steps)
        update = torch.cat([param.detach().reshape(-1).float() for param in params]) - start_vector
    finally:
        model.train(was_training)
    return {"steps": steps, "lr": lr, "update_norm": _norm(update)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-lopti diagnose",
        description="Token-probability diagnostics of a GRPO update (arXiv 2505.12929 Fig. 1 and 3, and the "
        "reviewers' questions): samples completions, scores them, and writes report.json, report.md and PNG plots.",
    )
    parser.add_argument("--model_name_or_path", required=True,
                        help="Local model folder, or 'smollm2' for the offline SmolLM2-135M-Instruct of trl_lopti.")
    parser.add_argument("--ref_model_name_or_path", default=None,
                        help="Reference model for the KL part of |w| (default: none, the policy is its reference).")
    parser.add_argument("--task", default="knights_knaves", choices=["knights_knaves", "toy"])
    parser.add_argument("--reward", default=None, choices=sorted(_BUILTIN_REWARDS),
                        help="Replace the task's reward by a built-in one: constant, length, toy, or kk_partial "
                        "(K&K: the paper's reward plus +-1/n per person whose role the response states; for small "
                        "models).")
    parser.add_argument("--num_people", type=int, default=3, help="Knights & Knaves puzzle size.")
    parser.add_argument("--num_prompts", type=int, default=4)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--epsilon_high", type=float, default=None)
    parser.add_argument("--loss_type", default="dapo", choices=list(SUPPORTED_LOSS_TYPES))
    parser.add_argument("--no_bias_correction_kl", action="store_true",
                        help="Plain k3 KL term (TRL's use_bias_correction_kl=False); default: times the ratio.")
    parser.add_argument("--inner_steps", type=int, default=0,
                        help="Adam steps of GRPO on the sampled batch before measuring (TRL's num_iterations - 1): "
                        "ratios differ from one, clipping and (with --beta) the KL part become active; the reference "
                        "is then the model that sampled the batch.")
    parser.add_argument("--inner_lr", type=float, default=1e-5, help="Learning rate of the --inner_steps.")
    parser.add_argument("--alpha", type=float, default=0.3, help="Advantage Reweighting strength of the probe.")
    parser.add_argument("--eta", type=float, default=0.5, help="Lopti threshold of the probe.")
    parser.add_argument("--lr", type=float, default=1e-3, help="Learning rate of the probe's single step.")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--probe_methods", default=",".join(DEFAULT_PROBE_METHODS),
                        help=f"Comma-separated, from {','.join(PROBE_METHODS)}; 'none' to skip the probe.")
    parser.add_argument("--no_summed_gradients", action="store_true",
                        help="Skip the per-quartile parameter gradients.")
    parser.add_argument("--micro_batch_size", type=int, default=4,
                        help="Completions per forward/backward; a multiple of num_generations shares prompt forwards.")
    parser.add_argument("--no_share_prompts", action="store_true",
                        help="Run every full sequence instead of sharing a prompt's forward among its completions.")
    parser.add_argument("--generation_batch_size", type=int, default=16)
    parser.add_argument("--torch_dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--output_dir", default="diagnostics")
    parser.add_argument("--no_plots", action="store_true", help="Write report.json and report.md only.")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def diagnose_main(argv: list[str] | None = None) -> int:
    """
    `trl-lopti diagnose`: sample a GRPO batch from a model on a task and write the token diagnostics.

    Writes `report.json` (everything, including the generation summary and the command), `report.md` (the tables)
    and `gradients.png` / `probability_shift.png` to `--output_dir`.

    Args:
        argv (`list[str]` or `None`, *optional*):
            Command-line arguments after `diagnose`; `None` reads `sys.argv`.

    Returns:
        `int`: Exit status, 0 on success.
    """
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = _parser().parse_args(argv)
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    if args.num_generations < 2:
        print("warning: num_generations < 2 gives zero advantages for every completion", file=sys.stderr)
    methods = [] if args.probe_methods.strip().lower() == "none" else [
        method.strip() for method in args.probe_methods.split(",") if method.strip()
    ]
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    dtype = getattr(torch, args.torch_dtype)
    model_path = _resolve_model_path(args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    ref_model = None
    if args.ref_model_name_or_path:
        ref_model = AutoModelForCausalLM.from_pretrained(_resolve_model_path(args.ref_model_name_or_path), dtype=dtype)
        ref_model.eval()
    prompts, extras, reward_func = _load_task(args.task, args.num_prompts, args.num_people, args.seed)
    if args.reward is not None:
        reward_func = _BUILTIN_REWARDS[args.reward]
    load_time = time.perf_counter() - started

    start = time.perf_counter()
    inputs, summary = generate_grpo_batch(
        model, tokenizer, prompts, extras, reward_func, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, temperature=args.temperature,
        generation_batch_size=args.generation_batch_size,
    )
    generation_time = time.perf_counter() - start
    logger.info("generated %d completions (mean reward %.3f) in %.1f s", summary["num_completions"],
                summary["reward_mean"], generation_time)

    inner = None
    if args.inner_steps > 0:
        start = time.perf_counter()
        inner = advance_policy_on_batch(
            model, inputs, args.inner_steps, args.inner_lr, temperature=args.temperature, beta=args.beta,
            epsilon_low=args.epsilon, epsilon_high=args.epsilon_high, loss_type=args.loss_type,
            use_bias_correction_kl=not args.no_bias_correction_kl, micro_batch_size=args.micro_batch_size,
        )
        inner["time_s"] = time.perf_counter() - start

    report = run_token_diagnostics(
        model, inputs, ref_model, temperature=args.temperature, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high, loss_type=args.loss_type, max_completion_length=args.max_completion_length,
        use_bias_correction_kl=not args.no_bias_correction_kl,
        summed_gradients=not args.no_summed_gradients, probe_methods=methods, lr=args.lr, optimizer=args.optimizer,
        alpha=args.alpha, eta=args.eta, micro_batch_size=args.micro_batch_size,
        share_prompt_forward=not args.no_share_prompts,
    )
    report["timing_s"].update({"load": load_time, "generation": generation_time,
                               "total": time.perf_counter() - started})
    report["generation"] = summary
    report["inner_steps"] = inner
    report["command"] = "trl-lopti diagnose " + " ".join(argv if argv is not None else sys.argv[1:])
    report["args"] = vars(args)
    report = _json_safe(report)

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / "report.json", "w") as handle:
        json.dump(report, handle, indent=2, allow_nan=False)
    tables = format_tables(report)
    (output_dir / "report.md").write_text(f"`{report['command']}`\n\n{tables}\n")
    if not args.no_plots:
        try:
            plot_report(report, output_dir)
        except ImportError as error:  # matplotlib is an optional dependency (the `demo` extra)
            logger.warning("no plots (%s); pip install matplotlib", error)
            args.no_plots = True
    print(tables)
    print(f"\nwrote report.json, report.md{'' if args.no_plots else ' and plots'} to {output_dir} in "
          f"{report['timing_s']['total']:.0f} s")
    return 0
