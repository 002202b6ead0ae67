"""A GRPO batch as the diagnostics see it: its settings, its forward passes and the summed gradients of its tokens."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core_algos import (
    lopti_batch_threshold,
    low_probability_token_mask,
    reweight_advantages,
    token_group_mask,
    token_level_advantages,
)
from .measure import (
    SUPPORTED_LOSS_TYPES,
    grpo_token_weights,
    hidden_state_gradient_norms,
    loss_normalizer,
    precise_logps,
    probability_quartiles,
)


@dataclass
class DiagnosticsSettings:
    r"""
    Settings of the token diagnostics: the loss they measure (as TRL's `GRPOTrainer` computes it), the AR and Lopti
    parameters of the probe, and how the passes are batched.

    Every entry point (`measure_token_gradients`, `probability_shift_probe`, `run_token_diagnostics`,
    `advance_policy_on_batch`) takes `settings` and, as keyword arguments, overrides of any of its fields.

    Args:
        temperature (`float`, *optional*, defaults to `1.0`):
            Temperature the log-probabilities are computed with (logits / temperature), as in TRL.
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient of the measured loss (TRL's `beta`).
        epsilon_low (`float`, *optional*, defaults to `0.2`):
            Lower clipping range of the importance ratio (TRL's `epsilon`).
        epsilon_high (`float` or `None`, *optional*):
            Upper clipping range (TRL's `epsilon_high`); `None` means `epsilon_low`.
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Loss normalisation: `"dapo"`, `"bnpo"`, `"grpo"` or `"dr_grpo"`.
        use_bias_correction_kl (`bool`, *optional*, defaults to `True`):
            Whether the KL term is multiplied by the importance ratio (TRL's `use_bias_correction_kl`).
        max_completion_length (`int` or `None`, *optional*):
            Normaliser of `"dr_grpo"`; defaults to the batch's completion width.
        alpha (`float`, *optional*, defaults to `0.3`):
            Advantage Reweighting strength of the probe's AR methods.
        eta (`float`, *optional*, defaults to `0.5`):
            Lopti threshold of the probe's Lopti methods (`LoptiGRPOConfig.lopti_threshold`).
        lopti_quantile (`float` or `None`, *optional*):
            When set, the probe's Lopti split is the quantile rule of `LoptiGRPOConfig.lopti_quantile` (eta of the
            batch at this quantile of its `pi_old`, [`~trl_lopti.core_algos.lopti_batch_threshold`]) instead of `eta`.
        micro_batch_size (`int`, *optional*, defaults to `4`):
            Completions per forward/backward pass.
        share_prompt_forward (`bool`, *optional*, defaults to `True`):
            Run a prompt shared by several completions of a micro-batch once and reuse its key/value cache (same
            result, about half the compute for long prompts; falls back to full sequences for models without a
            batch-selectable cache).
    """

    temperature: float = 1.0
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    use_bias_correction_kl: bool = True
    max_completion_length: int | None = None
    alpha: float = 0.3
    eta: float = 0.5
    lopti_quantile: float | None = None
    micro_batch_size: int = 4
    share_prompt_forward: bool = True

    def __post_init__(self):
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(
                f"loss_type must be one of {SUPPORTED_LOSS_TYPES} (the clipped-surrogate losses), "
                f"got {self.loss_type!r}"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be at least 1, got {self.micro_batch_size}")
        for name in ("temperature", "beta", "epsilon_low", "alpha", "eta"):
            setattr(self, name, float(getattr(self, name)))
        if self.epsilon_high is not None:
            self.epsilon_high = float(self.epsilon_high)

    @classmethod
    def resolve(cls, settings: DiagnosticsSettings | None = None, **overrides: Any) -> DiagnosticsSettings:
        """
        `settings` (or the defaults) with `overrides` applied, validated.

        Args:
            settings ([`DiagnosticsSettings`], *optional*):
                The base settings.
            **overrides:
                Fields to replace, e.g. `temperature=0.7`.

        Returns:
            [`DiagnosticsSettings`]: A new settings object.
        """
        return dataclasses.replace(settings if settings is not None else cls(), **overrides)

    @classmethod
    def from_trainer(cls, trainer: Any, **overrides: Any) -> DiagnosticsSettings:
        """
        The settings of the loss a TRL `GRPOTrainer` (or `LoptiGRPOTrainer`) optimises, with the trainer's AR alpha and
        Lopti eta for the probe when it is a `LoptiGRPOTrainer` (with Lopti on).

        The token weights model TRL's token-level clipped surrogate with its KL term and the normalisers of `dapo`,
        `bnpo`, `grpo` and `dr_grpo`. A trainer whose loss is another one (`cispo`, `sapo`, `luspo`, `vespo`, a
        sequence-level importance ratio, `delta` clipping, entropy masking or bonus, off-policy masking, vLLM
        importance-sampling correction) is refused with a `ValueError` that names the setting: the figures would be
        those of another loss.

        Args:
            trainer (`trl.GRPOTrainer`):
                The trainer.
            **overrides:
                Fields to replace.

        Returns:
            [`DiagnosticsSettings`]: The settings.
        """
        args = trainer.args
        check_loss_is_modelled(args)
        values = {
            "temperature": trainer.temperature,
            "beta": trainer.beta,
            "epsilon_low": trainer.epsilon_low,
            "epsilon_high": trainer.epsilon_high,
            "loss_type": trainer.loss_type,
            "use_bias_correction_kl": bool(args.use_bias_correction_kl),
            "max_completion_length": args.max_completion_length,
        }
        if getattr(args, "advantage_reweighting_alpha", None) is not None:
            values["alpha"] = args.advantage_reweighting_alpha
        if getattr(args, "lopti_enabled", False):
            if args.lopti_threshold is not None:
                values["eta"] = args.lopti_threshold
            else:
                values["lopti_quantile"] = args.lopti_quantile
        return cls(**{**values, **overrides})


def unmodelled_loss_settings(args: Any) -> list[str]:
    """
    The settings of a TRL `GRPOConfig` (or `LoptiGRPOConfig`) under which `GRPOTrainer` trains a loss other than the
    one the diagnostics' token weights model.

    Args:
        args (`trl.GRPOConfig`):
            The training configuration.

    Returns:
        `list[str]`: `"name=value"` per such setting; empty when the diagnostics measure exactly the trained loss.
    """
    found = []
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        found.append(f"loss_type={args.loss_type!r}")
    if args.importance_sampling_level != "token":
        found.append(f"importance_sampling_level={args.importance_sampling_level!r}")
    if args.delta is not None:
        found.append(f"delta={args.delta!r}")
    if args.top_entropy_quantile < 1.0:
        found.append(f"top_entropy_quantile={args.top_entropy_quantile!r}")
    if args.off_policy_mask_threshold is not None:
        found.append(f"off_policy_mask_threshold={args.off_policy_mask_threshold!r}")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        found.append(f"entropy_coef={args.entropy_coef!r}, use_adaptive_entropy={args.use_adaptive_entropy!r}")
    if args.use_vllm and args.vllm_importance_sampling_correction:
        found.append("use_vllm=True with vllm_importance_sampling_correction=True")
    return found


def check_loss_is_modelled(args: Any) -> None:
    """
    Raises a `ValueError` naming the settings when the diagnostics do not model the loss that `args` train.

    Args:
        args (`trl.GRPOConfig`):
            The training configuration.
    """
    unmodelled = unmodelled_loss_settings(args)
    if unmodelled:
        raise ValueError(
            f"the token diagnostics model TRL's token-level clipped surrogate (with its KL term) for loss_type in "
            f"{list(SUPPORTED_LOSS_TYPES)} and no other loss option; refusing to measure a run that trains with "
            f"{'; '.join(unmodelled)} (the figures would be those of another loss)"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Batch handling and forward passes
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class GRPOBatch:
    """The tensors of a GRPO batch the diagnostics use; advantages are per token (B, T), float32."""

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


def batch_from_inputs(inputs: dict[str, Any], device: torch.device, share_prompts: bool = True) -> GRPOBatch:
    """The batch of `inputs` (the dict of TRL's `_generate_and_score_completions`) on `device`."""
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

    return GRPOBatch(
        prompt_ids=inputs["prompt_ids"].to(device),
        prompt_mask=inputs["prompt_mask"].to(device),
        completion_ids=inputs["completion_ids"].to(device),
        completion_mask=completion_mask.long(),
        advantages=advantages,
        old_logps=optional("old_per_token_logps"),
        ref_logps=optional("ref_per_token_logps"),
        share_prompts=share_prompts,
    )


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter."""
    return next(model.parameters()).device


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The weight `W` (V, H) of the model's linear LM head; the closed forms need one, without logit soft-capping."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"the closed-form hidden-state gradient needs a linear LM head, got {type(head).__name__}")
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None):
        raise ValueError("the closed-form hidden-state gradient does not hold with final_logit_softcapping")
    return head.weight


def micro_batches(batch_size: int, micro_batch_size: int) -> list[slice]:
    """Row slices of at most `micro_batch_size` rows covering `batch_size` rows."""
    micro_batch_size = max(1, int(micro_batch_size))
    starts = range(0, batch_size, micro_batch_size)
    return [slice(start, min(start + micro_batch_size, batch_size)) for start in starts]


def completion_logits(model: torch.nn.Module, batch: GRPOBatch, rows: slice) -> tuple[torch.Tensor, int] | None:
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
        logits = shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        if logits is not None:
            return logits, num_tokens
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    output = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=num_tokens + 1, use_cache=False)
    logits = output.logits if hasattr(output, "logits") else output
    return logits[:, -(num_tokens + 1) : -1, :], num_tokens


def shared_prompt_logits(
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
def token_statistics(
    model: torch.nn.Module, batch: GRPOBatch, settings: DiagnosticsSettings, hidden_norms: bool = False
) -> dict[str, torch.Tensor]:
    """One no-grad forward: log-probabilities and (optionally) `||d log pi / d h||` of every completion token."""
    shape = batch.completion_ids.shape
    device = batch.completion_ids.device
    logps = torch.zeros(shape, dtype=torch.float64, device=device)
    norms = torch.zeros(shape, dtype=torch.float32, device=device)
    one_minus_p = torch.zeros(shape, dtype=torch.float32, device=device)
    weight = lm_head_weight(model) if hidden_norms else None
    for rows in micro_batches(batch.size, settings.micro_batch_size):
        result = completion_logits(model, batch, rows)
        if result is None:
            continue
        logits, num_tokens = result
        token_ids = batch.completion_ids[rows, :num_tokens]
        if hidden_norms:
            mb_norms, mb_logps, mb_one_minus_p = hidden_state_gradient_norms(
                logits, token_ids, weight, settings.temperature
            )
            norms[rows, :num_tokens] = mb_norms
            one_minus_p[rows, :num_tokens] = mb_one_minus_p
        else:
            mb_logps = precise_logps(logits, token_ids.long().unsqueeze(-1), settings.temperature)
        logps[rows, :num_tokens] = mb_logps
        del logits
    mask = batch.completion_mask.bool()
    return {
        "logps": logps.masked_fill(~mask, 0.0),
        "hidden_norms": norms.masked_fill(~mask, 0.0),
        "one_minus_p": one_minus_p.masked_fill(~mask, 0.0),
    }



def completion_log_probs(
    model: torch.nn.Module, inputs: dict[str, Any], temperature: float, micro_batch_size: int = 64
) -> torch.Tensor:
    """
    Log-probabilities of the completion tokens of a TRL generation batch under `model`, with no gradient.

    Args:
        model (`torch.nn.Module`):
            The policy.
        inputs (`dict[str, Any]`):
            `prompt_ids`, `prompt_mask`, `completion_ids`, `completion_mask`, `advantages` (the dict of TRL's
            `_generate_and_score_completions`).
        temperature (`float`):
            Logits are divided by it, as in TRL's loss.
        micro_batch_size (`int`, *optional*, defaults to `64`):
            Completions per forward.

    Returns:
        `torch.Tensor`: float64, shape of `completion_ids`, 0 on padding, on the model's device.
    """
    batch = batch_from_inputs(inputs, model_device(model))
    settings = DiagnosticsSettings(temperature=temperature, micro_batch_size=micro_batch_size)
    return token_statistics(model, batch, settings)["logps"]


# ---------------------------------------------------------------------------------------------------------------------
# Gradients of weighted token losses
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradSpec:
    """Which tokens are active (`tokens`: "all", "q0".."q3", "low", "high") and with which advantages ("A", "AR")."""

    tokens: str
    advantages: str = "A"


class TokenContext:
    """Per-token constants of one batch: pi_old, quartiles, Lopti split, normaliser, reweighted advantages."""

    def __init__(self, batch: GRPOBatch, logps_before: torch.Tensor, settings: DiagnosticsSettings):
        self.mask = batch.completion_mask.bool()
        old_logps = batch.old_logps if batch.old_logps is not None else logps_before
        self.old_logps = old_logps.masked_fill(~self.mask, 0.0)
        self.edges, self.quartile = probability_quartiles(self.old_logps.exp(), self.mask)
        self.eta = settings.eta
        if settings.lopti_quantile is not None:
            self.eta = lopti_batch_threshold(self.old_logps, self.mask, settings.lopti_quantile)
        self.low = low_probability_token_mask(self.old_logps, self.mask, self.eta)
        self.normalizer = loss_normalizer(batch.completion_mask, settings.loss_type, settings.max_completion_length)
        self.advantages = {
            "A": batch.advantages,
            "AR": reweight_advantages(batch.advantages, self.old_logps, settings.alpha),
        }

    def active(self, tokens: str) -> torch.Tensor:
        if tokens == "all":
            return self.mask
        if tokens in ("low", "high"):
            return token_group_mask(self.low, self.mask, tokens)
        if tokens.startswith("q"):
            return self.quartile == int(tokens[1:])
        raise ValueError(f"unknown token group {tokens!r}")


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters with `requires_grad`, in `model.parameters()` order (the order of the flat gradients)."""
    return [param for param in model.parameters() if param.requires_grad]


def weighted_gradients(
    model: torch.nn.Module,
    batch: GRPOBatch,
    context: _TokenContext,
    specs: Sequence[GradSpec],
    settings: DiagnosticsSettings,
) -> dict[GradSpec, torch.Tensor]:
    """Flat float32 gradients of `sum_t c_t * loss_t` over each spec's active tokens, at the model's parameters.

    Per micro-batch: one forward with grad, then one backward per spec of `sum_t coef_t * log pi_t` with the detached
    coefficient `coef_t = -c_t * w_t * active_t`, whose gradient equals that of the masked GRPO loss (see the module
    docstring). Gradients go through `torch.autograd.grad`, so `param.grad` is never touched.
    """
    params = trainable_parameters(model)
    sizes = [param.numel() for param in params]
    device = model_device(model)
    buffers = {spec: torch.zeros(sum(sizes), dtype=torch.float32, device=device) for spec in specs}
    if not specs:
        return buffers
    kl_active = settings.beta != 0.0 and batch.ref_logps is not None
    for rows in micro_batches(batch.size, settings.micro_batch_size):
        if not kl_active and not any(  # e.g. a group whose rewards are all equal: no gradient, skip its forward
            bool((context.active(spec.tokens)[rows] & (context.advantages[spec.advantages][rows] != 0)).any())
            for spec in specs
        ):
            continue
        result = completion_logits(model, batch, rows)
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



@torch.no_grad()
def reference_logps(batch: GRPOBatch, ref_model: torch.nn.Module | None, settings: DiagnosticsSettings) -> str:
    """Fills `batch.ref_logps` when a reference model is given and the batch lacks them; returns their source."""
    if batch.ref_logps is not None:
        return "inputs"
    if ref_model is None:
        return "none"
    batch.ref_logps = token_statistics(ref_model, batch, settings)["logps"]
    return "ref_model"

