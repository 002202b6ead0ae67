"""The diagnostics of one batch: the quartile table, the probability-shift probe and the inner steps."""

import logging
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.nn.utils import parameters_to_vector
from trl import GRPOTrainer

from ..config import LoptiGRPOConfig
from ..core_algos import (
    lopti_batch_threshold,
    loss_token_mask,
    low_probability_token_mask,
    reweight_advantages,
    token_group_mask,
    token_level_advantages,
)
from ..utils import trl_completion_logps
from .loss import model_mode, summed_parameter_gradients, trainable_parameters, trl_batch, trl_loss_gradients


logger = logging.getLogger(__name__)

QUARTILE_LABELS = ("Q1 (lowest)", "Q2", "Q3", "Q4 (highest)")


class ProbeUpdate(NamedTuple):
    """The first update of a probe method: the advantages it follows and the tokens it updates."""

    advantages: str  # "A" (the batch's) or "AR" (reweighted)
    tokens: str  # "all", "low" (Lopti, whose second update is on the "high" tokens), "q0" or "q3"


FIRST_UPDATE = {
    "grpo": ProbeUpdate("A", "all"),
    "ar": ProbeUpdate("AR", "all"),
    "lopti": ProbeUpdate("A", "low"),
    "lopti_ar": ProbeUpdate("AR", "low"),
    "lowest_quartile_only": ProbeUpdate("A", "q0"),
    "highest_quartile_only": ProbeUpdate("A", "q3"),
}
PROBE_METHODS = tuple(FIRST_UPDATE)
DEFAULT_PROBE_METHODS = ("grpo", "ar", "lopti", "lowest_quartile_only", "highest_quartile_only")
# The training arguments that shape TRL's loss, reported with the figures.
LOSS_SETTINGS = (
    "loss_type",
    "importance_sampling_level",
    "beta",
    "epsilon",
    "epsilon_high",
    "delta",
    "temperature",
    "use_bias_correction_kl",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "off_policy_mask_threshold",
    "use_vllm",
    "vllm_importance_sampling_correction",
)


def probability_quartiles(logps: torch.Tensor, mask: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """
    Groups the tokens of `mask` by the batch's quartiles of the probabilities `exp(logps)` (B, T).

    The edges are the quantiles at 0.25, 0.5 and 0.75 as the Lopti quantile split computes them
    ([`~trl_lopti.core_algos.lopti_batch_threshold`]).

    Returns:
        `tuple[list[float], torch.Tensor]`:
            The three edges (NaN without tokens) and the quartile of every token (B, T): `j` in [0, 3] for
            `[edge_j, edge_{j+1})` (the first from the minimum, the last to the maximum included), `-1`
            outside the mask.
    """
    logps = logps.detach().double()
    mask = mask.bool()
    if not mask.any():
        return [math.nan] * 3, torch.full_like(mask, -1, dtype=torch.long)
    edges = [lopti_batch_threshold(logps, mask, level) for level in (0.25, 0.5, 0.75)]
    quartile = sum((logps.exp() >= edge).long() for edge in edges)
    return edges, torch.where(mask, quartile, -1)


def probability_shift(
    logps_before: torch.Tensor, logps_after: torch.Tensor, advantages: torch.Tensor, quartile: torch.Tensor
) -> dict[str, Any]:
    """
    The paper's Fig.-3 statistic of one update: how the sampled tokens' probabilities moved.

    The moves from `logps_before` to `logps_after` (B, T) are counted per pi_old quartile (`quartile`,
    (B, T), from [`probability_quartiles`]) and sign of the advantage (`advantages`, (B,) or (B, T)). For
    `all`, `q0` ... `q3` the table holds `label`, `zero_advantage_count` and, for `positive` and `negative`
    advantages, `count`, `in_direction` (tokens whose probability rose for A > 0, fell for A < 0), their
    share `share_in_direction`, `mean_delta_prob` and `mean_delta_logp`.
    """
    delta_logp = logps_after.double() - logps_before.double()
    delta_p = logps_before.double().exp() * torch.expm1(delta_logp)
    sign = torch.sign(token_level_advantages(advantages, quartile.size(1)).double())
    table = {}
    for name, group in [("all", quartile >= 0), *((f"q{j}", quartile == j) for j in range(4))]:
        entry: dict[str, Any] = {"label": "all" if name == "all" else QUARTILE_LABELS[int(name[1:])]}
        for key, direction in (("positive", 1.0), ("negative", -1.0)):
            tokens = group & (sign == direction)
            moved = delta_logp[tokens] * direction > 0
            entry[key] = {
                "count": int(tokens.sum()),
                "in_direction": int(moved.sum()),
                "share_in_direction": _stat(moved),
                "mean_delta_prob": _stat(delta_p[tokens]),
                "mean_delta_logp": _stat(delta_logp[tokens]),
            }
        entry["zero_advantage_count"] = int((group & (sign == 0)).sum())
        table[name] = entry
    return table


def hidden_state_gradient_norms(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    lm_head_weight: torch.Tensor,
    temperature: float = 1.0,
    d_logps: torch.Tensor | None = None,
    d_entropies: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """
    Closed-form norms of gradients w.r.t. the last hidden state `h_t`, the LM head's input.

    With `logits = h @ W.T + b`, `z = logits / temperature`, `p = softmax(z)` and `k` the sampled token:
    `d log pi_t / d h_t = W.T (e_k - p) / temperature` and
    `d H_t / d h_t = -W.T (p * (log p + H_t)) / temperature`; `h_t` reaches no other token's log-probability
    or entropy. `1 - pi` is formed as the sum of the other tokens' probabilities (precise at pi ~ 1).

    `logits` (B, T, V) are the raw logits of the positions that predict the sampled `token_ids` (B, T),
    `lm_head_weight` is `W` (V, H); `d_logps` and `d_entropies` (B, T) are `d L / d log pi_t` and
    `d L / d H_t` of a loss `L`. Returns (B, T) each: `one_minus_p`, `unit` (`||d log pi_t / d h_t||`) and,
    with `d_logps`, `loss` (`||d L / d h_t||`).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    index = token_ids.long().unsqueeze(-1)
    log_p = torch.log_softmax(logits.detach().to(dtype) / temperature, dim=-1)
    p = log_p.exp()
    weight = lm_head_weight.detach().to(dtype)

    def norm_at_hidden(direction: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(direction @ weight, dim=-1) / temperature

    e_minus_p = (-p).scatter_(-1, index, 0.0)
    one_minus_p = -e_minus_p.sum(-1)
    e_minus_p.scatter_(-1, index, one_minus_p.unsqueeze(-1))
    norms = {"one_minus_p": one_minus_p, "unit": norm_at_hidden(e_minus_p)}
    if d_logps is not None:
        direction = d_logps.to(dtype).unsqueeze(-1) * e_minus_p
        if d_entropies is not None and bool(d_entropies.any()):
            entropy = -(p * log_p).sum(-1, keepdim=True)
            direction -= d_entropies.to(dtype).unsqueeze(-1) * p * (log_p + entropy)
        norms["loss"] = norm_at_hidden(direction)
    return norms


@torch.no_grad()
def completion_statistics(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    temperature: float,
    micro_batch_size: int = 4,
    d_logps: torch.Tensor | None = None,
    d_entropies: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """
    `logps` and, with `d_logps`, `hidden_state_gradient_norms` of every completion token of a TRL batch.

    They come from the model's plain forward (no gradient), 0 on padding; `logps` is float64 from the logits
    over `temperature`.
    """
    num_tokens = inputs["completion_ids"].size(1)
    stats: dict[str, list[torch.Tensor]] = {}
    for start in range(0, inputs["completion_ids"].size(0), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        input_ids = torch.cat([inputs["prompt_ids"][rows], inputs["completion_ids"][rows]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"][rows], inputs["completion_mask"][rows]], dim=1)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=num_tokens + 1).logits
        ids = inputs["completion_ids"][rows]
        # The logits of the positions that predict the completion.
        logits = logits[:, :-1]
        scaled = logits.double() / temperature
        values = {"logps": scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)}
        if d_logps is not None:
            weight = lm_head_weight(model)
            norms = hidden_state_gradient_norms(logits, ids, weight, temperature, d_logps[rows], d_entropies[rows])
            values.update(norms)
        for key, value in values.items():
            stats.setdefault(key, []).append(value.double())
    mask = loss_token_mask(inputs).bool()
    return {key: torch.cat(values).masked_fill(~mask, 0.0) for key, values in stats.items()}


def completion_log_probs(
    model: torch.nn.Module, inputs: dict[str, Any], temperature: float, micro_batch_size: int = 64
) -> torch.Tensor:
    """Log-probabilities under `model` of the completion tokens of a TRL batch (no gradient, 0 on padding).

    The batch holds `prompt_ids`, `prompt_mask`, `completion_ids` and `completion_mask`; the
    log-probabilities are float64, from the logits over `temperature`."""
    inputs = trl_batch([inputs], next(model.parameters()).device)
    return completion_statistics(model, inputs, temperature, micro_batch_size)["logps"]


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The weight of the model's linear LM head, for the closed form (which soft-capped logits break)."""
    head = model.get_output_embeddings()
    config = model.config.get_text_config()
    if not isinstance(head, torch.nn.Linear) or getattr(config, "final_logit_softcapping", None):
        raise ValueError("the hidden-state gradient norms need a linear LM head without logit soft-capping")
    return head.weight


def run_token_diagnostics(
    trainer: GRPOTrainer,
    inputs: dict[str, Any],
    *,
    summed_gradients: bool = True,
    probe_methods: Sequence[str] = DEFAULT_PROBE_METHODS,
    lr: float = 1e-3,
    optimizer: str = "sgd",
    micro_batch_size: int = 4,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """
    The token diagnostics of a batch under the loss the trainer trains: TRL's `_compute_loss`, by autograd.

    Cost: two no-grad forwards (TRL's, and a plain one for the logits); with `summed_gradients`, one forward
    with grad and four backward passes, and `4 x num_trainable_params` float32; per probe method, one forward
    with grad and one backward per update and a no-grad forward. The model (`trainer.model`, in eval mode
    meanwhile) is left as it was.

    Args:
        trainer (`GRPOTrainer`):
            TRL's `GRPOTrainer` or a `LoptiGRPOTrainer`.
        inputs (`dict[str, Any]`):
            A batch of TRL's `_generate_and_score_completions` (`sample_generation_batch`,
            `generation_batch`).
        summed_gradients (`bool`, *optional*, defaults to `True`):
            Whether to measure each quartile's summed parameter gradient too.
        probe_methods (`Sequence[str]`, *optional*, defaults to `DEFAULT_PROBE_METHODS`):
            The probe's methods, of `PROBE_METHODS`; none: no probe.
        lr (`float`, *optional*, defaults to `1e-3`):
            The learning rate of the probe's updates.
        optimizer (`str`, *optional*, defaults to `"sgd"`):
            The optimizer of each probe method's step: `"sgd"` or a fresh `"adam"` (Lopti: one step per pass,
            with the same optimizer).
        micro_batch_size (`int`, *optional*, defaults to `4`):
            How many completions go per forward.
        ref_model (`torch.nn.Module`, *optional*):
            A reference model for the KL term, in place of the batch's `ref_per_token_logps`.

    Returns:
        `dict[str, Any]`:
            `{"gradients": ..., "probe": ... or None, "time_s": ...}`, JSON-serialisable (see the package
            docstring).
    """
    check_probe_methods(probe_methods, trainer.args)
    model = trainer.accelerator.unwrap_model(trainer.model)
    started = time.perf_counter()
    # No dropout, and TRL's loss in its evaluation branch.
    with model_mode(trainer.model, training=False):
        batch = trl_batch([inputs], next(model.parameters()).device)
        with torch.no_grad():
            values = trl_completion_logps(trainer, batch, model, batch_size=micro_batch_size, compute_entropy=True)
        logps, entropies = values
        # What TRL uses on-policy (`per_token_logps.detach()`).
        batch.setdefault("old_per_token_logps", logps)
        if ref_model is not None:
            ref_logps = completion_log_probs(ref_model, batch, trainer.temperature, micro_batch_size)
            batch["ref_per_token_logps"] = ref_logps.to(logps.dtype)
        if trainer.beta and "ref_per_token_logps" not in batch:
            raise ValueError("beta > 0: the batch needs ref_per_token_logps (TRL adds them), or pass a ref_model")
        mask = loss_token_mask(batch).bool()
        old_logps = batch["old_per_token_logps"]
        d_logps, d_entropies = trl_loss_gradients(trainer, batch, logps, entropies)
        d_no_kl = d_logps
        if trainer.beta:
            d_no_kl, _ = trl_loss_gradients(trainer, batch, logps, entropies, without_kl=True)
        stats = completion_statistics(model, batch, trainer.temperature, micro_batch_size, d_logps, d_entropies)
        edges, quartile = probability_quartiles(old_logps, mask)
        groups = {"all": mask, **{f"q{j}": quartile == j for j in range(4)}}
        # w = -N dL/dlog pi: for dapo and bnpo, each token's own weight.
        scale = max(int(mask.sum()), 1)
        stats.update(w=-scale * d_logps, w_no_kl=-scale * d_no_kl, entropy_weight=-scale * d_entropies)
        advantages = token_level_advantages(batch["advantages"], mask.size(1))
        stats.update(loss=scale * stats["loss"], advantages=advantages, pi_old=old_logps.exp(), quartile=quartile)
        quartile_grads = None
        if summed_gradients:
            pairs = [(d_logps * groups[f"q{j}"], d_entropies * groups[f"q{j}"]) for j in range(4)]
            quartile_grads = summed_parameter_gradients(trainer, model, batch, pairs, micro_batch_size)
        report = {"gradients": quartile_table(trainer, model, groups, edges, stats, quartile_grads), "probe": None}
        kl_reference = "ref_model" if ref_model is not None else "inputs" if trainer.beta else None
        report["gradients"]["kl_reference"] = kl_reference
        report["time_s"] = {"gradients": time.perf_counter() - started}
        if probe_methods:
            update = {"optimizer": optimizer, "lr": lr}
            report["probe"] = probe(
                trainer, model, batch, values, groups, stats, update, probe_methods, micro_batch_size
            )
            report["time_s"]["probe"] = time.perf_counter() - started - report["time_s"]["gradients"]
    return report


def check_probe_methods(methods: Sequence[str], args: Any) -> None:
    """Raises `ValueError` for a probe method not in `PROBE_METHODS`, or for a Lopti probe without Lopti.

    A Lopti probe (`lopti`, `lopti_ar`) needs a `LoptiGRPOConfig` `args` with Lopti on; under TRL's
    `GRPOConfig` it uses the paper's eta."""
    if unknown := [method for method in methods if method not in PROBE_METHODS]:
        raise ValueError(f"probe_methods: unknown {unknown}; choose from {list(PROBE_METHODS)}")
    if not getattr(args, "lopti_enabled", True) and any(FIRST_UPDATE[method].tokens == "low" for method in methods):
        raise ValueError("probe_methods: the Lopti probes need Lopti on (a lopti_threshold or a lopti_quantile)")


def quartile_table(
    trainer: GRPOTrainer,
    model: torch.nn.Module,
    groups: dict[str, torch.Tensor],
    edges: list[float],
    stats: dict[str, torch.Tensor],
    quartile_grads: list[torch.Tensor] | None,
) -> dict[str, Any]:
    """The `gradients` part of a report: one row of figures per probability quartile of pi_old."""
    probs = stats["pi_old"]
    nonzero = stats["advantages"] != 0
    ratio = stats["unit"] / stats["one_minus_p"].clamp(min=1e-300)
    full = sum(quartile_grads) if quartile_grads is not None else None
    rows = []
    for j in range(4):
        group = groups[f"q{j}"]
        w = stats["w"][group].abs()
        w_no_kl = stats["w_no_kl"][group].abs()
        row = {
            "label": QUARTILE_LABELS[j],
            "count": int(group.sum()),
            "prob_min": _stat(probs[group], "min"),
            "prob_max": _stat(probs[group], "max"),
            "prob_mean": _stat(probs[group]),
            "abs_w_mean": _stat(w),
            "abs_w_median": _stat(w, "median"),
            "abs_w_no_kl_mean": _stat(w_no_kl),
            "abs_w_no_kl_median": _stat(w_no_kl, "median"),
            "abs_w_kl_part_mean": _stat((stats["w"] - stats["w_no_kl"])[group].abs()),
            "abs_entropy_weight_mean": _stat(stats["entropy_weight"][group].abs()),
            "zero_advantage_share": _stat(~nonzero[group]),
            "no_gradient_share": _stat(stats["w_no_kl"][group & nonzero] == 0),
            "hidden_grad_norm_mean": _stat(stats["loss"][group]),
            "unit_hidden_grad_norm_mean": _stat(stats["unit"][group]),
            "ratio_to_one_minus_p_mean": _stat(ratio[group]),
            "ratio_to_one_minus_p_max": _stat(ratio[group], "max"),
        }
        if full is not None:
            grad = quartile_grads[j]
            row.update(summed_grad_norm=_norm(grad), cos_with_full=_cosine(grad, full))
            row["contribution_to_full"] = _dot(grad, full) / max(_dot(full, full), 1e-300)
        rows.append(row)
    sigma = float(torch.linalg.matrix_norm(lm_head_weight(model).detach().double(), ord=2))
    bound = math.sqrt(2) * sigma / trainer.temperature
    table = {
        "num_completions": int(groups["all"].size(0)),
        "num_tokens": int(groups["all"].sum()),
        "quartile_edges": [edge if math.isfinite(edge) else None for edge in edges],
        "loss": {name: getattr(trainer.args, name, None) for name in LOSS_SETTINGS},
        "quartiles": rows,
        "bound": {"lm_head_spectral_norm": sigma, "ratio_to_one_minus_p_upper_bound": bound},
    }
    if full is not None:
        table["full_grad_norm"] = _norm(full)
        table["summed_grad_cosine"] = [[_cosine(a, b) for b in quartile_grads] for a in quartile_grads]
    keys = (
        "hidden_grad_norm_mean",
        "unit_hidden_grad_norm_mean",
        "summed_grad_norm",
        "abs_w_mean",
        "abs_w_no_kl_mean",
    )
    lowest_over_highest = {}
    for key in keys:
        low = rows[0].get(key)
        high = rows[-1].get(key)
        lowest_over_highest[key] = low / high if low is not None and high else None
    table["lowest_over_highest"] = lowest_over_highest
    return table


def probe(
    trainer: GRPOTrainer,
    model: torch.nn.Module,
    batch: dict[str, Any],
    values: tuple[torch.Tensor, torch.Tensor],
    groups: dict[str, torch.Tensor],
    stats: dict[str, torch.Tensor],
    settings: dict[str, Any],
    methods: Sequence[str],
    micro_batch_size: int,
) -> dict[str, Any]:
    """
    One update of the model per method, the shift of every token's probability, then the parameters restored.

    `settings` holds the update's `optimizer` and `lr`; `values` are TRL's per-token log-probabilities and
    entropies at the current parameters. AR's alpha and Lopti's eta are the trainer's `LoptiGRPOConfig`
    fields (`LoptiGRPOConfig`'s defaults for a TRL `GRPOConfig`); with `lopti_quantile`, eta is that quantile
    of pi_old.
    """
    mask = groups["all"]
    old_logps = batch["old_per_token_logps"]
    args = trainer.args
    alpha = getattr(args, "advantage_reweighting_alpha", LoptiGRPOConfig.advantage_reweighting_alpha)
    quantile = getattr(args, "lopti_quantile", None)
    eta = getattr(args, "lopti_threshold", LoptiGRPOConfig.lopti_threshold)
    if quantile is not None:
        eta = lopti_batch_threshold(old_logps, mask, quantile)
    settings = {**settings, "alpha": alpha, "eta": eta, "lopti_quantile": quantile}
    if eta is not None:
        low = low_probability_token_mask(old_logps, mask, eta)
        low_tokens = token_group_mask(low, mask, "low")
        high_tokens = token_group_mask(low, mask, "high")
        groups = {**groups, "low": low_tokens, "high": high_tokens}
    reweighted = reweight_advantages(batch["advantages"], old_logps, alpha)
    variants = {"A": batch, "AR": {**batch, "advantages": reweighted}}
    params = trainable_parameters(model)
    start = [param.detach().clone() for param in params]
    results = {}
    for method in methods:
        first = FIRST_UPDATE[method]
        variant = variants[first.advantages]
        optimizer = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[settings["optimizer"]]
        update = optimizer(params, lr=settings["lr"])
        try:
            gradient_step(trainer, model, variant, update, groups[first.tokens], micro_batch_size, values)
            # Lopti's high pass, from the new parameters, with ratio and clipping against pi_old.
            if first.tokens == "low":
                gradient_step(trainer, model, variant, update, groups["high"], micro_batch_size)
            moved = parameters_to_vector(params).detach() - parameters_to_vector(start)
            after = completion_log_probs(model, batch, trainer.temperature, micro_batch_size)
            shift = probability_shift(stats["logps"], after, stats["advantages"], stats["quartile"])
            results[method] = {"update_norm": _norm(moved), "groups": shift}
        finally:
            # The parameters back, exactly.
            with torch.no_grad():
                for param, value in zip(params, start, strict=True):
                    param.copy_(value)
        logger.info("probe %s done", method)
    low_count = int(groups["low"].sum()) if "low" in groups else None
    return {**settings, "low_token_count": low_count, "methods": results}


def gradient_step(
    trainer: GRPOTrainer,
    model: torch.nn.Module,
    batch: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    micro_batch_size: int,
    values: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One `optimizer` step with the part of TRL's loss gradient on `batch` that flows through `tokens`.

    `values` are TRL's per-token log-probabilities and entropies at the current parameters, if known. The
    parameters' `.grad` are kept."""
    if values is None:
        with torch.no_grad():
            values = trl_completion_logps(trainer, batch, model, batch_size=micro_batch_size, compute_entropy=True)
    pair = tuple(value * tokens for value in trl_loss_gradients(trainer, batch, *values))
    flat = summed_parameter_gradients(trainer, model, batch, [pair], micro_batch_size)[0]
    params = trainable_parameters(model)
    previous = [param.grad for param in params]
    for param, grad in zip(params, flat.split([param.numel() for param in params]), strict=True):
        param.grad = grad.view_as(param).to(param.dtype)
    optimizer.step()
    for param, grad in zip(params, previous, strict=True):
        param.grad = grad


def advance_policy_on_batch(
    trainer: GRPOTrainer, inputs: dict[str, Any], steps: int, lr: float, micro_batch_size: int = 4
) -> dict[str, Any]:
    """
    Updates the trainer's model with `steps` Adam steps (learning rate `lr`) of TRL's loss on `inputs`.

    The model is updated in place as TRL does with `num_iterations = steps + 1`: the diagnostics then see
    ratios away from one, clipping and, with `beta > 0`, a KL part. First the batch's log-probabilities under
    the model (TRL's forward) are stored in `inputs` as `old_per_token_logps` (the behaviour policy) and,
    with `beta > 0` and none there, `ref_per_token_logps`. Returns `{"steps", "lr", "update_norm"}`.
    """
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = trainable_parameters(model)
    start = [param.detach().clone() for param in params]
    # No dropout, and TRL's loss in its evaluation branch.
    with model_mode(trainer.model, training=False):
        batch = trl_batch([inputs], start[0].device)
        with torch.no_grad():
            logps, _ = trl_completion_logps(trainer, batch, model, batch_size=micro_batch_size)
        inputs["old_per_token_logps"] = batch["old_per_token_logps"] = logps
        if trainer.beta and "ref_per_token_logps" not in batch:
            inputs["ref_per_token_logps"] = batch["ref_per_token_logps"] = logps
        update = torch.optim.Adam(params, lr=lr)
        for _ in range(steps):
            gradient_step(trainer, model, batch, update, loss_token_mask(batch), micro_batch_size)
    moved = parameters_to_vector(params).detach() - parameters_to_vector(start)
    return {"steps": steps, "lr": lr, "update_norm": _norm(moved)}


def _dot(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 22) -> float:
    """Dot product accumulated in float64 chunk by chunk (a float32 sum over ~1e8 entries is off by ~1%)."""
    return sum(float(a[i : i + chunk].double() @ b[i : i + chunk].double()) for i in range(0, a.numel(), chunk))


def _norm(a: torch.Tensor) -> float:
    return math.sqrt(max(_dot(a, a), 0.0))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    denominator = _norm(a) * _norm(b)
    return _dot(a, b) / denominator if denominator > 0 else None


def _stat(values: torch.Tensor, how: str = "mean") -> float | None:
    values = values.double()[torch.isfinite(values)]
    if values.numel() == 0:
        return None
    # The median of an even count is the mean of the two middle values.
    if how == "median":
        return float(torch.quantile(values, 0.5))
    return float(getattr(values, how)())
