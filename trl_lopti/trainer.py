"""`LoptiGRPOTrainer`: TRL's `GRPOTrainer` with Advantage Reweighting and Low-Probability Token Isolation.

The math is in `trl_lopti/core_algos.py`; this file is plumbing. TRL still computes every loss, KL, clipping,
importance-sampling and normalisation term itself; this trainer only changes, per token, the advantage that TRL's
loss reads, and (for Lopti) which tokens carry gradient in which pass.

How it hooks into TRL 1.16 (each fact is pinned by `tests/test_trl_contract.py`):

1. `GRPOTrainer._compute_loss(model, inputs)` calls `self._get_per_token_logps_and_entropies(model, ...)` exactly
   once for the policy, and only afterwards reads `inputs["advantages"]`, `inputs["old_per_token_logps"]` and
   `inputs["ref_per_token_logps"]`; it accepts token-level advantages of shape (B, T). `compute_loss` hands TRL a
   shallow copy of `inputs` and arms a one-shot hook on `_get_per_token_logps_and_entropies`; the hook sees the
   policy's log-probabilities and rewrites the copy's advantages (AR weights, Lopti token isolation) before TRL
   reads them. In on-policy runs (where TRL computes no old log-probabilities because they equal the current ones)
   this gets `pi_old` from TRL's own forward: AR costs no extra forward pass.
2. `GRPOTrainer._prepare_inputs` generates when `self._step % (steps_per_generation * num_iterations) == 0`, keeps
   the split generation batch in `self._buffered_inputs` and hands out slice `self._step % steps_per_generation`;
   `GRPOTrainer.training_step` increments `self._step` once per micro-step. Lopti is a schedule over that counter:
   the generation batch is served twice, `steps_per_generation * num_iterations` micro-steps per pass, the first
   pass through TRL's `_prepare_inputs`, the second replaying `self._buffered_inputs`. Every optimizer step stays an
   ordinary Trainer step (gradient synchronisation, clipping, scheduler, DeepSpeed and FSDP untouched).
3. The train dataloader repeats each generation batch `num_iterations * steps_per_generation` times (TRL's
   `RepeatSampler`, or `repeat_iterable_dataset` for iterable datasets), both read from `self.num_iterations`; with
   Lopti the dataloader is built with twice that repeat count so an epoch still covers every prompt once.

Cost of one generation batch, in forward+backward passes of the policy: plain GRPO runs one forward+backward per
micro-batch per iteration (`steps_per_generation * num_iterations` per device), plus one no-grad forward for old
log-probabilities only where TRL needs them (off-policy schedules, vLLM importance sampling). AR adds nothing.
Lopti runs that schedule twice (2 x forward+backward) and adds no forward of its own: in on-policy runs `pi_old` is
captured from the first pass's forward. A pass that has no active token anywhere in the generation batch (on any
process) is skipped when this is known before it starts (always for the second pass; for the first pass when TRL
precomputed old log-probabilities): its micro-steps run no forward or backward, produce no gradient, and the
optimizer leaves the parameters untouched (the scheduler still advances). Under DeepSpeed empty passes run normally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from .config import LoptiGRPOConfig
from .core_algos import (
    LOPTI_PASS_ORDERS,
    advantage_reweighting_weights,
    isolate_advantages,
    lopti_active_token_mask,
    low_probability_token_mask,
    neutralize_inactive_kl,
    reweight_advantages,
    stop_gradient_where_inactive,
    token_level_advantages,
)


logger = logging.getLogger(__name__)

# Key under which the first pass stores the pi_old log-probabilities it captured, in TRL's buffered micro-batch.
CAPTURED_OLD_LOGPS_KEY = "lopti_captured_old_per_token_logps"


@dataclass
class _LossHookState:
    """What the one-shot hook on `_get_per_token_logps_and_entropies` needs to rewrite one micro-batch."""

    loss_inputs: dict[str, Any]  # the copy of `inputs` that TRL's `_compute_loss` reads
    buffered_inputs: dict[str, Any]  # the trainer's buffered micro-batch (where captured pi_old is stored)
    token_group: str | None  # "low", "high", or None (no Lopti: every token active)
    mode: str  # "train" or "eval"


def as_lopti_config(args: GRPOConfig | None, model: Any) -> LoptiGRPOConfig:
    """
    Returns a `LoptiGRPOConfig` for `args`.

    A `LoptiGRPOConfig` passes through. A plain `GRPOConfig` (a user who only swapped the trainer class) becomes a
    `LoptiGRPOConfig` with the same values and the paper's defaults for the new fields. `None` gives the defaults,
    with TRL's naming of the output folder.

    Args:
        args (`GRPOConfig` or `None`):
            The configuration given to the trainer.
        model (`str` or `PreTrainedModel`):
            The model given to the trainer (names the default output folder).

    Returns:
        `LoptiGRPOConfig`: The configuration to train with.
    """
    if isinstance(args, LoptiGRPOConfig):
        return args
    if args is None:
        model_name = model if isinstance(model, str) else model.config._name_or_path
        return LoptiGRPOConfig(output_dir=f"{str(model_name).split('/')[-1]}-Lopti-GRPO")
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be a LoptiGRPOConfig or a GRPOConfig, got {type(args).__name__}")
    values = {
        config_field.name: getattr(args, config_field.name)
        for config_field in dataclasses.fields(GRPOConfig)
        if config_field.init
    }
    # GRPOConfig.__post_init__ filled in generation_batch_size from steps_per_generation; both set is an error.
    values["generation_batch_size"] = None
    logger.info(
        "LoptiGRPOTrainer got a plain GRPOConfig: using its values with the paper's Advantage Reweighting "
        "(alpha=%s) and Lopti (eta=%s) defaults.",
        LoptiGRPOConfig.advantage_reweighting_alpha,
        LoptiGRPOConfig.lopti_threshold,
    )
    return LoptiGRPOConfig(**values)


class LoptiGRPOTrainer(GRPOTrainer):
    """
    TRL's `GRPOTrainer` with Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti), arXiv 2505.12929.

    Same constructor and arguments as `GRPOTrainer`. `args` should be a [`LoptiGRPOConfig`]; a plain `GRPOConfig`
    is upgraded with the paper's defaults (`advantage_reweighting_alpha=0.3`, `lopti_threshold=0.5`).

    - AR replaces each completion's advantage `A(i)` by the token-level `(alpha * pi_old(i, t) + 1 - alpha) * A(i)`.
      The KL penalty is not reweighted.
    - Lopti splits the completion tokens of each generation batch once by `pi_old < lopti_threshold` and trains the
      batch twice: first with only the low tokens active (zero advantage, KL and entropy-bonus gradient for the
      others, same loss normaliser), then with only the high tokens active, from the parameters the first pass
      produced and with importance ratios against the same `pi_old`. Each pass is the whole schedule plain GRPO
      runs on a generation batch, so Lopti makes twice the optimizer steps per generation batch.

    Cost (forward/backward passes of the policy per generation batch, per device): GRPO runs
    `steps_per_generation * num_iterations` forward+backward passes (plus one no-grad forward for old
    log-probabilities where TRL needs them). AR adds none. Lopti runs `2 * steps_per_generation * num_iterations`
    forward+backward passes and no additional forward. A pass with no active token anywhere, known before it
    starts, costs nothing (see the module docstring).

    Logged metrics (W&B-friendly, prefix `lopti/`): `lopti/low_token_share` (share of completion tokens with
    `pi_old < eta`, or `< 0.5` where Lopti is off), `lopti/ar_weight_mean` (mean AR weight over completion tokens),
    `lopti/active_token_share` (share of completion tokens active in the current pass), and
    `lopti/loss_low_pass` / `lopti/loss_high_pass` (the loss of each pass, per optimizer step).

    Checkpoints: the Trainer counts optimizer steps, so a checkpoint can fall between the two passes. A resumed
    run, like a resumed `GRPOTrainer`, starts a fresh generation cycle: it generates anew and runs a low pass
    (in `"low_first"` order) before any high pass, so no high pass ever runs without its low pass.
    """

    _tag_names = ["trl", "grpo", "lopti"]
    _name = "Lopti-GRPO"

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *extra_args, **kwargs):
        args = as_lopti_config(args, model)
        super().__init__(model, reward_funcs, args, *extra_args, **kwargs)
        self.advantage_reweighting_alpha = args.advantage_reweighting_alpha
        self.lopti_threshold = args.lopti_threshold
        self.lopti_pass_order = LOPTI_PASS_ORDERS[args.lopti_order]
        self._lopti_token_group: str | None = None  # token group active in the current training micro-step
        self._lopti_skip_pass = False  # the current pass has no active token on any process
        self._loss_hook_state: _LossHookState | None = None

    # ------------------------------------------------------------------------------------------------ schedule
    @property
    def lopti_pass_micro_steps(self) -> int:
        """Micro-steps in one Lopti pass: the schedule plain GRPO runs on one generation batch."""
        return self.args.steps_per_generation * self.num_iterations

    def lopti_pass_index(self, micro_step: int | None = None) -> int:
        """
        Which pass (0 or 1) a training micro-step belongs to.

        Args:
            micro_step (`int` or `None`, *optional*):
                TRL's micro-step counter; defaults to the current one (`self._step`).

        Returns:
            `int`: 0 for the first pass of its generation batch, 1 for the second.
        """
        micro_step = self._step if micro_step is None else micro_step
        return (micro_step % (2 * self.lopti_pass_micro_steps)) // self.lopti_pass_micro_steps

    def get_train_dataloader(self):
        if self.lopti_threshold is None:
            return super().get_train_dataloader()
        # TRL's sampler repeats each generation batch `self.num_iterations * steps_per_generation` times; Lopti serves
        # it twice as often. Doubling `num_iterations` only while the dataloader is built doubles that repeat count
        # for map-style (RepeatSampler) and iterable datasets alike, and nothing else.
        with _temporarily_set(self, "num_iterations", 2 * self.num_iterations):
            return super().get_train_dataloader()

    def training_step(self, model, inputs, num_items_in_batch):
        if self.lopti_threshold is not None:
            pass_index = self.lopti_pass_index()
            self._lopti_token_group = self.lopti_pass_order[pass_index]
            if self._step % self.lopti_pass_micro_steps == 0:  # first micro-step of a pass: decided in compute_loss
                self._lopti_skip_pass = None
        return super().training_step(model, inputs, num_items_in_batch)

    def _prepare_inputs(self, generation_batch):
        if self.lopti_threshold is None or not self.model.training or self.lopti_pass_index() == 0:
            return super()._prepare_inputs(generation_batch)
        # Second pass: replay the generation batch of the first pass (TRL's `_step` keeps counting, so it does not
        # generate here: it generates again at the start of the next cycle).
        buffered = self._buffered_inputs[self._step % self.args.steps_per_generation]
        if "old_per_token_logps" not in buffered and CAPTURED_OLD_LOGPS_KEY not in buffered:
            raise RuntimeError("Lopti second pass without the pi_old of its first pass; please report this bug.")
        return buffered

    # ------------------------------------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        token_group = self._lopti_token_group if (mode == "train" and self.lopti_threshold is not None) else None
        if token_group is not None:
            if self._lopti_skip_pass is None:
                self._lopti_skip_pass = self._pass_has_no_active_token(token_group)
            if self._lopti_skip_pass:
                self._log_pass_loss(token_group, torch.zeros((), device=self.accelerator.device))
                # A leaf with no graph: backward touches no parameter, gradients stay None and the optimizer
                # skips every parameter.
                return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        loss_inputs = dict(inputs)
        if token_group is not None and "old_per_token_logps" not in loss_inputs and CAPTURED_OLD_LOGPS_KEY in inputs:
            # Second pass of an on-policy run: the ratio is against the pi_old captured in the first pass.
            loss_inputs["old_per_token_logps"] = inputs[CAPTURED_OLD_LOGPS_KEY]
        self._loss_hook_state = _LossHookState(loss_inputs, inputs, token_group, mode)
        try:
            loss = super().compute_loss(model, loss_inputs, return_outputs, num_items_in_batch)
        finally:
            hook_state_left = self._loss_hook_state
            self._loss_hook_state = None
        if hook_state_left is not None:
            raise RuntimeError(
                "GRPOTrainer._compute_loss no longer calls _get_per_token_logps_and_entropies: this TRL version is "
                "not supported by trl_lopti."
            )
        if token_group is not None:
            self._log_pass_loss(token_group, loss.detach())
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        per_token_logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        hook_state, self._loss_hook_state = self._loss_hook_state, None
        if hook_state is not None:
            entropies = self._apply_token_weighting(hook_state, per_token_logps, entropies)
        return per_token_logps, entropies, aux_loss

    def _apply_token_weighting(
        self, hook_state: _LossHookState, per_token_logps: torch.Tensor, entropies: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Rewrites the advantages (and, for Lopti, the KL reference and entropy gradient) TRL is about to read."""
        loss_inputs = hook_state.loss_inputs
        completion_mask = loss_inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in loss_inputs else completion_mask * loss_inputs["tool_mask"]
        old_per_token_logps = loss_inputs.get("old_per_token_logps")
        if old_per_token_logps is None:
            # On-policy: TRL itself uses these detached log-probs as pi_old (its forward is at the behaviour policy).
            old_per_token_logps = per_token_logps.detach()
            if hook_state.token_group is not None:
                hook_state.buffered_inputs[CAPTURED_OLD_LOGPS_KEY] = old_per_token_logps

        advantages = loss_inputs["advantages"]
        if self.advantage_reweighting_alpha != 0.0:
            advantages = reweight_advantages(advantages, old_per_token_logps, self.advantage_reweighting_alpha)

        if hook_state.token_group is not None:
            active_mask = lopti_active_token_mask(
                old_per_token_logps, mask, self.lopti_threshold, hook_state.token_group
            )
            advantages = isolate_advantages(advantages, active_mask)
            if self.beta != 0.0:
                loss_inputs["ref_per_token_logps"] = neutralize_inactive_kl(
                    loss_inputs["ref_per_token_logps"], per_token_logps, active_mask
                )
            if entropies is not None:
                entropies = stop_gradient_where_inactive(entropies, active_mask)
            self._log_token_share("lopti/active_token_share", active_mask, mask, hook_state.mode)
        loss_inputs["advantages"] = advantages

        low_mask = low_probability_token_mask(old_per_token_logps, mask, self.lopti_threshold or 0.5)
        self._log_token_share("lopti/low_token_share", low_mask, mask, hook_state.mode)
        if self.advantage_reweighting_alpha != 0.0:
            weights = advantage_reweighting_weights(old_per_token_logps, self.advantage_reweighting_alpha)
            self._log_masked_mean("lopti/ar_weight_mean", weights, mask, hook_state.mode)
        return entropies

    # ------------------------------------------------------------------------------------------------ helpers
    def _pass_has_no_active_token(self, token_group: str) -> bool:
        """Whether the pass starting now has no active token on any process (False where unknown yet)."""
        if self.is_deepspeed_enabled:
            return False
        active_tokens = 0
        for micro_batch in self._buffered_inputs:
            old_per_token_logps = micro_batch.get("old_per_token_logps", micro_batch.get(CAPTURED_OLD_LOGPS_KEY))
            if old_per_token_logps is None:
                return False  # on-policy first pass: pi_old comes from this pass's own forward
            mask = micro_batch["completion_mask"]
            if "tool_mask" in micro_batch:
                mask = mask * micro_batch["tool_mask"]
            active = lopti_active_token_mask(old_per_token_logps, mask, self.lopti_threshold, token_group)
            active_tokens += int(active.sum())
        total = self.accelerator.reduce(torch.tensor(active_tokens, device=self.accelerator.device), reduction="sum")
        return int(total) == 0

    def _log_pass_loss(self, token_group: str, loss: torch.Tensor) -> None:
        # The loss TRL returns is one micro-step's share of its optimizer step; scaled back to a per-step value.
        per_step_loss = loss * self.current_gradient_accumulation_steps
        value = self.accelerator.gather(per_step_loss.reshape(1)).mean().item()
        self._metrics["train"][f"lopti/loss_{token_group}_pass"].append(value)

    def _log_token_share(self, name: str, selected: torch.Tensor, mask: torch.Tensor, mode: str) -> None:
        self._log_masked_mean(name, selected.float(), mask, mode)

    def _log_masked_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor, mode: str) -> None:
        mask = mask.to(values.dtype)
        totals = torch.stack([(values * mask).sum(), mask.sum()]).float()
        totals = self.accelerator.reduce(totals, reduction="sum")
        if totals[1] > 0:
            self._metrics[mode][name].append((totals[0] / totals[1]).item())


@contextlib.contextmanager
def _temporarily_set(obj: Any, name: str, value: Any):
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)


__all__ = ["LoptiGRPOTrainer", "as_lopti_config", "token_level_advantages"]
