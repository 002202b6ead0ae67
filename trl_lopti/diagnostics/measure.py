"""Pure per-token and per-quartile figures of a GRPO batch (see the conventions in `trl_lopti.diagnostics`).

Everything here is a function of tensors: token weights of TRL's clipped surrogate, loss normalisers, probability
quartiles, the closed-form norm of a token's hidden-state gradient, and the tables built from them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..core_algos import token_level_advantages


QUARTILE_LABELS = ("Q1 (lowest)", "Q2", "Q3", "Q4 (highest)")
SUPPORTED_LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")


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
    logps = precise_logps(logits, index, temperature)
    logp_all = torch.log_softmax(logits.detach().float() / temperature, dim=-1)
    direction = logp_all.exp_().neg_()  # -p, then e_k - p, in place of the log-probabilities to save memory
    direction.scatter_(-1, index, 0.0)
    one_minus_p = -direction.sum(-1)
    direction.scatter_(-1, index, one_minus_p.unsqueeze(-1))
    weight = lm_head_weight.detach().float()
    norms = torch.linalg.vector_norm(direction @ weight, dim=-1) / temperature
    return norms, logps, one_minus_p


def precise_logps(logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
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
# Vectors, statistics and tables
# ---------------------------------------------------------------------------------------------------------------------
def dot(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 22) -> float:
    """Dot product of two flat vectors accumulated in float64, chunk by chunk (float32 reductions over ~1e8 entries
    are off by about a percent; converting whole vectors would double their memory)."""
    return sum(float(a[i : i + chunk].double() @ b[i : i + chunk].double()) for i in range(0, a.numel(), chunk))


def norm(a: torch.Tensor) -> float:
    """Euclidean norm of a flat vector, accumulated in float64."""
    return math.sqrt(max(dot(a, a), 0.0))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Cosine of two flat vectors; `None` when one of them is zero."""
    denominator = norm(a) * norm(b)
    return dot(a, b) / denominator if denominator > 0 else None



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



def quartile_table(
    batch: Any,
    context: Any,
    stats: dict[str, torch.Tensor],
    settings: Any,
    quartile_grads: Sequence[torch.Tensor] | None,
    lm_head_sigma: float,
    ref_source: str,
) -> dict[str, Any]:
    """
    The `gradients` part of a diagnostics report: one row of figures per probability quartile.

    Args:
        batch (`trl_lopti.diagnostics.batch.GRPOBatch`):
            The batch (advantages, reference log-probabilities, size).
        context (`trl_lopti.diagnostics.batch.TokenContext`):
            Its per-token constants (mask, `pi_old`, quartiles).
        stats (`dict[str, torch.Tensor]`):
            `logps`, `hidden_norms` and `one_minus_p` of every completion token at the current parameters.
        settings ([`~trl_lopti.diagnostics.DiagnosticsSettings`]):
            Temperature, KL and clipping settings.
        quartile_grads (`Sequence[torch.Tensor]` or `None`):
            The four quartiles' summed parameter gradients (flat), or `None` to leave the gradient columns out.
        lm_head_sigma (`float`):
            Largest singular value of the LM head weight.
        ref_source (`str`):
            Where the reference log-probabilities came from: `"inputs"`, `"ref_model"` or `"none"`.

    Returns:
        `dict[str, Any]`: See [`~trl_lopti.diagnostics.run_token_diagnostics`].
    """
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
        full = sum(quartile_grads)
        full_sq = dot(full, full)
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
            grad = quartile_grads[j]
            row["summed_grad_norm"] = norm(grad)
            row["cos_with_full"] = cosine(grad, full)
            row["contribution_to_full"] = dot(grad, full) / full_sq if full_sq > 0 else None
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
        report["full_grad_norm"] = norm(full)
        report["summed_grad_cosine"] = [[cosine(a, b) for b in quartile_grads] for a in quartile_grads]
    lowest, highest = quartiles[0], quartiles[-1]
    report["lowest_over_highest"] = {
        key: _ratio(lowest.get(key), highest.get(key))
        for key in ("hidden_grad_norm_mean", "unit_hidden_grad_norm_mean", "summed_grad_norm", "abs_w_mean",
                    "abs_w_no_kl_mean")
    }
    return report


def shift_table(
    context: Any, advantages: torch.Tensor, logps_before: torch.Tensor, logps_after: torch.Tensor
) -> dict[str, Any]:
    """Per quartile and advantage sign: how the sampled tokens' probabilities moved from `logps_before`."""
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


def json_safe(value: Any) -> Any:
    """`value` with tensors as lists and non-finite floats as `None` (JSON refuses NaN)."""
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, torch.Tensor):
        return json_safe(value.tolist())
    return value
