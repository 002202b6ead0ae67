"""Entry points of the token diagnostics: the quartile table, the probability-shift probe, and inner steps.

The gradients at the starting parameters (the four quartiles' and those the probe needs) come from a single forward
with grad per micro-batch followed by one backward per distinct gradient; the GRPO, lowest-only and highest-only probe
updates reuse the quartile gradients (they are their sum, Q1 and Q4).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from .batch import (
    DiagnosticsSettings,
    GradSpec,
    GRPOBatch,
    TokenContext,
    batch_from_inputs,
    lm_head_weight,
    model_device,
    reference_logps,
    token_statistics,
    trainable_parameters,
    weighted_gradients,
)
from .measure import json_safe, lm_head_spectral_norm, norm, quartile_table, shift_table


logger = logging.getLogger(__name__)

PROBE_METHODS = ("grpo", "ar", "lopti", "lopti_ar", "lowest_quartile_only", "highest_quartile_only")
DEFAULT_PROBE_METHODS = ("grpo", "ar", "lopti", "lowest_quartile_only", "highest_quartile_only")


def measure_token_gradients(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    ref_model: torch.nn.Module | None = None,
    settings: DiagnosticsSettings | None = None,
    *,
    summed_gradients: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """
    Per probability quartile: token count, |w| with and without KL, per-token hidden-state gradient norms, and the
    norms and cosines of the quartiles' summed parameter gradients.

    Cost: one no-grad forward of `model` (plus one of `ref_model` when given and `inputs` lack
    `ref_per_token_logps`); with `summed_gradients`, one more forward with grad and four backward passes, and
    `4 x num_trainable_params` float32 of memory. All passes run over micro-batches of `settings.micro_batch_size`.

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
        settings ([`DiagnosticsSettings`], *optional*):
            Loss and batching settings; defaults to `DiagnosticsSettings()`.
        summed_gradients (`bool`, *optional*, defaults to `True`):
            Whether to compute the summed parameter gradients per quartile (the expensive part).
        **overrides:
            Fields of [`DiagnosticsSettings`] to replace (e.g. `temperature=0.7, beta=0.04`).

    Returns:
        `dict[str, Any]`: A JSON-serialisable report; see [`run_token_diagnostics`].
    """
    report = run_token_diagnostics(model, inputs, ref_model, settings, summed_gradients=summed_gradients,
                                   probe_methods=(), **overrides)  # fmt: skip
    return report["gradients"]


def probability_shift_probe(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    ref_model: torch.nn.Module | None = None,
    settings: DiagnosticsSettings | None = None,
    *,
    methods: Sequence[str] = DEFAULT_PROBE_METHODS,
    lr: float = 1e-3,
    optimizer: str = "sgd",
    **overrides: Any,
) -> dict[str, Any]:
    """
    Applies one update per method to a copy of `model` and reports how the sampled tokens' probabilities moved.

    Methods: `"grpo"` (all tokens), `"ar"` (advantages reweighted with `settings.alpha`), `"lopti"` (a step on the
    tokens with `pi_old < settings.eta`, then a step on the others from the new parameters, ratio and clipping relative
    to `pi_old`, same optimizer), `"lopti_ar"` (both), `"lowest_quartile_only"` and `"highest_quartile_only"` (only Q1
    or Q4 active). Inactive tokens get a zero advantage and a zero KL term; the loss normaliser is never changed. For
    each method, per quartile (of `pi_old`) and per advantage sign: the token count, the share of tokens whose
    probability moved in the direction of their advantage (judged on the change of log-probability), and the mean
    change of probability. Changes are measured against the model's own probabilities before the update.

    Cost: two no-grad forwards (before, plus one per method after), one forward with grad and one backward per
    distinct gradient (at most 5), plus one forward and backward per Lopti method; one model copy at a time.

    Args:
        model (`torch.nn.Module`):
            The policy; it is not modified.
        inputs (`dict[str, Any]`):
            A GRPO batch, as for [`measure_token_gradients`].
        ref_model (`torch.nn.Module` or `None`, *optional*):
            Reference model for the KL term when `inputs` lack `ref_per_token_logps`.
        settings ([`DiagnosticsSettings`], *optional*):
            Loss, AR/Lopti and batching settings.
        methods (`Sequence[str]`, *optional*):
            Methods to probe, from `PROBE_METHODS`.
        lr (`float`, *optional*, defaults to `1e-3`):
            Learning rate of the single step.
        optimizer (`str`, *optional*, defaults to `"sgd"`):
            `"sgd"` (interpretable: the update is `-lr * grad`) or `"adam"` (a fresh Adam, as at the start of
            training).
        **overrides:
            Fields of [`DiagnosticsSettings`] to replace.

    Returns:
        `dict[str, Any]`: The `"probe"` part of [`run_token_diagnostics`]'s report.
    """
    probe_settings = DiagnosticsSettings.resolve(settings, **overrides)
    report = run_token_diagnostics(model, inputs, ref_model, probe_settings, summed_gradients=False,
                                   probe_methods=methods, lr=lr, optimizer=optimizer)  # fmt: skip
    return report["probe"]


def run_token_diagnostics(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    ref_model: torch.nn.Module | None = None,
    settings: DiagnosticsSettings | None = None,
    *,
    summed_gradients: bool = True,
    probe_methods: Sequence[str] = DEFAULT_PROBE_METHODS,
    lr: float = 1e-3,
    optimizer: str = "sgd",
    **overrides: Any,
) -> dict[str, Any]:
    """
    Runs the quartile measurements and the probability-shift probe on one batch, sharing their gradients.

    Memory beyond the model: one flat float32 buffer of the trainable parameters per distinct gradient (4 quartiles,
    plus AR and the Lopti low pass when probed), one model copy with its optimizer state during the probe, and the
    activations of one micro-batch.

    Args:
        model (`torch.nn.Module`):
            The policy: a causal LM with a linear LM head. It is not modified (the probe updates copies).
        inputs (`dict[str, Any]`):
            A GRPO batch (see [`measure_token_gradients`]).
        ref_model (`torch.nn.Module` or `None`, *optional*):
            Reference model for the KL part when `inputs` lack `ref_per_token_logps`.
        settings ([`DiagnosticsSettings`], *optional*):
            Loss, AR/Lopti and batching settings.
        summed_gradients (`bool`, *optional*, defaults to `True`):
            Whether to compute the per-quartile summed parameter gradients.
        probe_methods (`Sequence[str]`, *optional*):
            Methods for the probability-shift probe (see [`probability_shift_probe`]); empty to skip the probe.
        lr (`float`, *optional*, defaults to `1e-3`):
            Probe learning rate.
        optimizer (`str`, *optional*, defaults to `"sgd"`):
            Probe optimizer, `"sgd"` or `"adam"`.
        **overrides:
            Fields of [`DiagnosticsSettings`] to replace.

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
    settings = DiagnosticsSettings.resolve(settings, **overrides)
    batch = batch_from_inputs(inputs, model_device(model), settings.share_prompt_forward)
    timing: dict[str, float] = {}
    was_training = model.training
    model.eval()
    try:
        start = time.perf_counter()
        ref_source = reference_logps(batch, ref_model, settings)
        stats = token_statistics(model, batch, settings, hidden_norms=True)
        context = TokenContext(batch, stats["logps"], settings)
        sigma = lm_head_spectral_norm(lm_head_weight(model))
        timing["token_statistics"] = time.perf_counter() - start
        logger.info("token statistics of %d tokens in %.1f s", int(context.mask.sum()), timing["token_statistics"])

        quartile_specs = [GradSpec(f"q{j}") for j in range(4)] if summed_gradients else []
        specs = list(quartile_specs)
        for method in probe_methods:
            first, _ = _probe_specs(method)
            if first not in specs and not (first == GradSpec("all") and summed_gradients):
                specs.append(first)
        start = time.perf_counter()
        grads = weighted_gradients(model, batch, context, specs, settings)
        timing["gradients"] = time.perf_counter() - start
        logger.info("%d summed gradients in %.1f s", len(specs), timing["gradients"])

        quartile_grads = [grads[spec] for spec in quartile_specs] if summed_gradients else None
        report = {
            "gradients": quartile_table(batch, context, stats, settings, quartile_grads, sigma, ref_source),
            "probe": None,
        }
        if probe_methods:
            start = time.perf_counter()
            report["probe"] = _run_probe(model, batch, context, stats["logps"], grads, settings, probe_methods, lr,
                                         optimizer)  # fmt: skip
            timing["probe"] = time.perf_counter() - start
    finally:
        model.train(was_training)
    report["timing_s"] = timing
    return json_safe(report)


def _probe_specs(method: str) -> tuple[GradSpec, GradSpec | None]:
    """First-step gradient at the starting parameters, and the second step's for the Lopti methods."""
    advantages = "AR" if method in ("ar", "lopti_ar") else "A"
    if method in ("grpo", "ar"):
        return GradSpec("all", advantages), None
    if method in ("lopti", "lopti_ar"):
        return GradSpec("low", advantages), GradSpec("high", advantages)
    if method == "lowest_quartile_only":
        return GradSpec("q0"), None
    if method == "highest_quartile_only":
        return GradSpec("q3"), None
    raise ValueError(f"unknown probe method {method!r}; choose from {PROBE_METHODS}")


def _resolve_gradient(spec: GradSpec, grads: dict[GradSpec, torch.Tensor]) -> torch.Tensor:
    if spec in grads:
        return grads[spec]
    if spec.tokens == "all":  # the quartiles partition the completion tokens, so their gradients sum to the full one
        return sum(grads[GradSpec(f"q{j}", spec.advantages)] for j in range(4))
    raise KeyError(spec)


def _flat_parameters(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([param.detach().reshape(-1).float() for param in params])


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


def _run_probe(
    model: torch.nn.Module,
    batch: GRPOBatch,
    context: TokenContext,
    logps_before: torch.Tensor,
    grads: dict[GradSpec, torch.Tensor],
    settings: DiagnosticsSettings,
    methods: Sequence[str],
    lr: float,
    optimizer_name: str,
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
        params = trainable_parameters(updated)
        optimizer = _make_optimizer(params, optimizer_name, lr)
        start_vector = _flat_parameters(params)
        _apply_flat_gradient(params, optimizer, _resolve_gradient(first, grads))
        if second is not None:  # Lopti: the high tokens from the new parameters, ratio and clipping against pi_old
            second_grad = weighted_gradients(updated, batch, context, [second], settings)[second]
            _apply_flat_gradient(params, optimizer, second_grad)
            del second_grad
        update_norm = norm(_flat_parameters(params) - start_vector)
        logps_after = token_statistics(updated, batch, settings)["logps"]
        results[method] = {
            "update_norm": update_norm,
            "groups": shift_table(context, batch.advantages, logps_before, logps_after),
        }
        del updated, optimizer, params, start_vector
        logger.info("probe %s done", method)
    return {
        "optimizer": optimizer_name,
        "lr": lr,
        "alpha": settings.alpha,
        "eta": context.eta,
        "lopti_quantile": settings.lopti_quantile,
        "token_counts": sign_counts,
        "low_token_count": int(context.low.sum()),
        "methods": results,
    }


def advance_policy_on_batch(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    steps: int,
    lr: float,
    settings: DiagnosticsSettings | None = None,
    **overrides: Any,
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
        settings ([`DiagnosticsSettings`], *optional*):
            Loss and batching settings.
        **overrides:
            Fields of [`DiagnosticsSettings`] to replace.

    Returns:
        `dict[str, Any]`: `{"steps", "lr", "update_norm"}`.
    """
    settings = DiagnosticsSettings.resolve(settings, **overrides)
    batch = batch_from_inputs(inputs, model_device(model), settings.share_prompt_forward)
    was_training = model.training
    model.eval()
    try:
        logps = token_statistics(model, batch, settings)["logps"].float()
        inputs["old_per_token_logps"] = logps
        batch.old_logps = logps
        if settings.beta != 0.0:
            inputs["ref_per_token_logps"] = logps.clone()
            batch.ref_logps = inputs["ref_per_token_logps"]
        context = TokenContext(batch, logps, settings)
        params = trainable_parameters(model)
        start_vector = _flat_parameters(params)
        optimizer = _make_optimizer(params, "adam", lr)
        spec = GradSpec("all")
        for step in range(steps):
            grad = weighted_gradients(model, batch, context, [spec], settings)[spec]
            _apply_flat_gradient(params, optimizer, grad)
            logger.info("inner step %d/%d done", step + 1, steps)
        update = _flat_parameters(params) - start_vector
    finally:
        model.train(was_training)
    return {"steps": steps, "lr": lr, "update_norm": norm(update)}
