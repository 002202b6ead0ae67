"""The oracle: the gradient of TRL's `GRPOTrainer._compute_loss` w.r.t. each token's log-prob and entropy."""

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from trl import GRPOTrainer

from ..core_algos import loss_token_mask
from ..lopti_mixin import LOPTI_BATCH_KEYS
from ..tasks._text import completion_to_text
from ..utils import temporarily_set, trl_completion_logps


def trl_batch(micro_batches: Sequence[dict[str, Any]], device: torch.device | None = None) -> dict[str, Any]:
    """One batch (on `device`) of batches of `_generate_and_score_completions` or of TRL's micro-batches.

    The micro-batches are those TRL splits a generation batch into (text models). The batch holds the tensors
    of TRL's keys, rows concatenated; what `LoptiGRPOTrainer` adds (`LOPTI_BATCH_KEYS`), and a key that some
    micro-batch lacks, are left out. `num_items_in_batch` (one scalar for a whole generation batch) is the
    first one's, or counted."""
    batch = {}
    for key in [key for key in micro_batches[0] if key not in LOPTI_BATCH_KEYS]:
        values = [micro_batch.get(key) for micro_batch in micro_batches]
        if all(isinstance(value, torch.Tensor) for value in values):
            value = values[0] if values[0].dim() == 0 else torch.cat(values)
            batch[key] = value.to(device) if device is not None else value
    batch.setdefault("num_items_in_batch", loss_token_mask(batch).sum())
    return batch


def generation_batch(trainer: GRPOTrainer) -> dict[str, Any] | None:
    """The generation batch the trainer trains on now (`_buffered_inputs`, joined); `None` before one."""
    buffered = getattr(trainer, "_buffered_inputs", None)
    return trl_batch(buffered) if buffered else None


def sample_generation_batch(trainer: GRPOTrainer, rows: Sequence[dict[str, Any]]) -> tuple[dict, dict]:
    """
    One generation batch of `rows`, generated, scored and given advantages by the trainer as in training.

    `rows` are dataset rows: a `prompt` and the columns the rewards read. The trainer (TRL's or a
    `LoptiGRPOTrainer`) gets each row `num_generations` times, consecutively, as TRL's `RepeatSampler` does,
    through `_generate_and_score_completions`.

    Returns:
        `tuple[dict, dict]`:
            The batch (`trl_batch`) and a summary (rewards, lengths, zero-advantage completions, three sample
            texts; from TRL's completions log `trainer._logs`).
    """
    repeated = [dict(row) for row in rows for _ in range(trainer.num_generations)]
    with model_mode(trainer.model, training=True):
        inputs = trl_batch([trainer._generate_and_score_completions(repeated)])
    per_function = torch.tensor([list(values) for values in trainer._logs["rewards"].values()], dtype=torch.float32)
    rewards = torch.nan_to_num(per_function[:, -len(repeated) :], nan=0.0).sum(0)
    texts = [completion_to_text(completion) for completion in list(trainer._logs["completion"])[-len(repeated) :]]
    summary = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rewards": rewards.tolist(),
        "completion_length_mean": float(inputs["completion_mask"].sum(1).float().mean()),
        "num_completions": int(inputs["completion_ids"].size(0)),
        "num_zero_advantage_completions": int((inputs["advantages"] == 0).sum()),
        "sample_completions": texts[:3],
    }
    return inputs, summary


@contextlib.contextmanager
def model_mode(model: torch.nn.Module, training: bool) -> Iterator[None]:
    """`model` in training or eval mode for the block, then back in the mode it was in."""
    was_training = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was_training)


def trl_loss_gradients(
    trainer: GRPOTrainer,
    inputs: dict[str, Any],
    per_token_logps: torch.Tensor,
    entropies: torch.Tensor,
    without_kl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    `d L / d log pi_t` and `d L / d H_t` (B, T) of TRL's loss `L = GRPOTrainer._compute_loss(model, inputs)`.

    They are taken at the values `per_token_logps` and `entropies` of TRL's forward on `inputs`: the weight
    TRL gives each token, for every loss type and option (a `LoptiGRPOTrainer`'s too: TRL's loss, without AR
    or Lopti).

    The one patch: for this call, the trainer's `_get_per_token_logps_and_entropies` returns these values as
    leaf tensors (the variables of the derivative). With `trainer.model` in eval mode the loss takes TRL's
    evaluation branch (no gradient-accumulation factor, no entropy-controller update); what TRL logs
    meanwhile is discarded. With `without_kl`, TRL's loss at `beta = 0` on the same batch: `beta` touches
    nothing but the KL term, so that is exactly the loss without it.
    """
    logps = per_token_logps.detach().clone().requires_grad_(True)
    entropy = entropies.detach().clone().requires_grad_(True)
    # The auxiliary loss is not a token's: it is left out.
    aux_loss = torch.zeros((), device=logps.device) if trainer.aux_loss_enabled else None

    def leaf_forward(*args, **kwargs):
        return logps, entropy, aux_loss

    # TRL's loss at beta 0 is the same loss without its KL term.
    beta = 0.0 if without_kl else trainer.beta
    # What TRL logs meanwhile goes there, then away.
    metrics = {mode: defaultdict(list) for mode in trainer._metrics}
    patch = temporarily_set(trainer, _get_per_token_logps_and_entropies=leaf_forward, beta=beta, _metrics=metrics)
    with patch, torch.enable_grad():
        loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    d_logps, d_entropies = torch.autograd.grad(loss, (logps, entropy), allow_unused=True)
    d_logps = torch.zeros_like(logps) if d_logps is None else d_logps
    d_entropies = torch.zeros_like(entropy) if d_entropies is None else d_entropies
    return d_logps, d_entropies


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters with `requires_grad`, in `model.parameters()` order (that of the flat gradients)."""
    return [param for param in model.parameters() if param.requires_grad]


def summed_parameter_gradients(
    trainer: GRPOTrainer,
    model: torch.nn.Module,
    inputs: dict[str, Any],
    token_gradients: Sequence[tuple[torch.Tensor, torch.Tensor]],
    micro_batch_size: int = 4,
) -> list[torch.Tensor]:
    """
    Flat parameter gradients `sum_t (g_t * d log pi_t / d theta + h_t * d H_t / d theta)`, one per pair.

    `token_gradients` holds the `(g, h)` pairs of (B, T) weights. With `(g, h)` = `trl_loss_gradients` times
    a token mask, this is exactly the part of the gradient of TRL's loss that flows through those tokens (the
    chain rule); masks that partition the tokens give gradients that add up to the full one. Per micro-batch
    of `micro_batch_size` completions: one forward with grad (TRL's) and one backward per pair
    (`torch.autograd.grad`: `param.grad` is not touched). Float32 buffers (float64 models: float64).
    """
    params = trainable_parameters(model)
    dtype = torch.promote_types(params[0].dtype, torch.float32)
    num_params = sum(param.numel() for param in params)
    sums = [torch.zeros(num_params, dtype=dtype, device=params[0].device) for _ in token_gradients]
    for start in range(0, inputs["completion_ids"].size(0), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        pairs = [(index, g[rows], h[rows]) for index, (g, h) in enumerate(token_gradients)]
        pairs = [(index, g, h) for index, g, h in pairs if g.any() or h.any()]
        # No gradient (e.g. a group whose rewards are all equal, and no KL): no forward.
        if not pairs:
            continue
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        micro_batch = {key: inputs[key][rows] for key in keys}
        with torch.enable_grad():
            logps, entropies = trl_completion_logps(trainer, micro_batch, model, compute_entropy=True)
        for position, (index, g, h) in enumerate(pairs):
            outputs = (logps, entropies) if h.any() else (logps,)
            weights = (g, h) if h.any() else (g,)
            retain = position < len(pairs) - 1
            grads = torch.autograd.grad(outputs, params, weights, retain_graph=retain, allow_unused=True)
            grads = [torch.zeros_like(p) if grad is None else grad for p, grad in zip(params, grads, strict=True)]
            sums[index] += torch.cat([grad.reshape(-1).to(dtype) for grad in grads])
    return sums
