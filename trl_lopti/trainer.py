"""`LoptiGRPOTrainer`: TRL's `GRPOTrainer` with Advantage Reweighting, Low-Probability Token Isolation and REINFORCE++.

The math is in `trl_lopti/core_algos.py`; this file is plumbing. TRL still computes every loss, KL, clipping,
importance-sampling and normalisation term itself; this trainer changes, per token, the advantage TRL's loss reads
(AR) and through which tokens' log-probabilities and entropies gradient flows in which pass (Lopti).

The TRL 1.16 facts it relies on, each pinned by `tests/test_trl_contract.py`:

1. `GRPOTrainer._compute_loss(model, inputs)` calls `self._get_per_token_logps_and_entropies` exactly once for the
   policy and reads `inputs["advantages"]` and `inputs["old_per_token_logps"]` only afterwards; it accepts
   token-level advantages (B, T). `compute_loss` gives TRL a shallow copy of `inputs` and, for the duration of that
   one call, has the override of `_get_per_token_logps_and_entropies` rewrite the copy's advantages (AR) and return
   log-probabilities and entropies whose gradient flows only through the pass's active tokens (Lopti). On-policy,
   where TRL computes no old log-probabilities, `pi_old` is the detached output of that forward: no extra forward.
2. `GRPOTrainer._prepare_inputs` generates when `self._step % (steps_per_generation * num_iterations) == 0`, buffers
   the split generation batch in `self._buffered_inputs` and serves slice `self._step % steps_per_generation`;
   `training_step` increments `self._step` after each micro-step. Lopti is a schedule over that counter: each
   generation batch is served once per pass (README, "The Lopti schedule"), the first pass through TRL's
   `_prepare_inputs`, the later ones replaying `self._buffered_inputs`. Every optimizer step is an ordinary Trainer
   step (gradient synchronisation, clipping, scheduler, DeepSpeed and FSDP untouched).
3. The train sampler repeats each generation batch `num_iterations * steps_per_generation` times, read from
   `self.num_iterations` while the dataloader is built; Lopti builds it with one repeat per pass.
4. `_calculate_rewards` returns the rewards of the whole generation batch, gathered over processes in process
   order, and `_generate_and_score_completions` calls it once (REINFORCE++ reads it there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import textwrap
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from . import _compat  # noqa: F401, I001  (checks the TRL version before TRL is imported)
from trl import GRPOConfig, GRPOTrainer

from .config import LoptiGRPOConfig, lopti_pass_ends_on_optimizer_step, lopti_schedule_error
from .core_algos import (
    advantage_reweighting_weights,
    isolate_token_gradients,
    lopti_active_token_mask,
    low_probability_token_mask,
    reinforce_plus_plus_advantages,
    token_group_mask,
    token_level_advantages,
)


# Key under which the first pass stores the pi_old log-probabilities it captured, in TRL's buffered micro-batch.
CAPTURED_OLD_LOGPS_KEY = "lopti_captured_old_per_token_logps"

# The threshold for `lopti/low_token_share` when Lopti is off (the paper's eta), so GRPO and AR runs log it too.
UNSPLIT_REPORTING_THRESHOLD = 0.5

LOPTI_PAPER_CITATION = textwrap.dedent("""\
    @article{yang2025lopti,
        title        = {{Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs}},
        author       = {Zhihe Yang and Xufang Luo and Zilong Wang and Dongqi Han and Zhiyuan He and Dongsheng Li and Yunjian Xu},
        year         = 2025,
        eprint       = {arXiv:2505.12929},
    }""")


@dataclass
class _TokenWeighting:
    """What the log-prob forward of one `compute_loss` call must do to the micro-batch TRL is about to read."""

    loss_inputs: dict[str, Any]  # the copy of `inputs` that TRL's `_compute_loss` reads (advantages rewritten here)
    buffered_inputs: dict[str, Any]  # the buffered micro-batch (the first pass stores its captured pi_old here)
    token_group: str | None  # "low" or "high": the tokens that carry gradient in this pass; None: every token
    first_pass: bool  # whether this is the first pass over the generation batch (or there is only one)
    mode: str  # "train" or "eval"
    applied: bool = False


def as_lopti_config(args: GRPOConfig | None, model: Any) -> LoptiGRPOConfig:
    """
    Returns a `LoptiGRPOConfig` for `args`.

    A `LoptiGRPOConfig` passes through. A plain `GRPOConfig` (a user who only swapped the trainer class) becomes a
    `LoptiGRPOConfig` with the same values and the paper's defaults for the new fields, with a warning that says so.
    `None` gives the defaults, with TRL's naming of the output folder.

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
    if not lopti_pass_ends_on_optimizer_step(args):
        raise ValueError(lopti_schedule_error(args, upgraded_from_grpo_config=True))
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
    # GRPOConfig.__post_init__ filled in generation_batch_size from steps_per_generation; both set is an error.
    values["generation_batch_size"] = None
    defaults = LoptiGRPOConfig
    warnings.warn(
        "LoptiGRPOTrainer got a plain GRPOConfig and turns on the paper's defaults: Advantage Reweighting "
        f"(advantage_reweighting_alpha={defaults.advantage_reweighting_alpha}) and Lopti "
        f"(lopti_threshold={defaults.lopti_threshold}, lopti_order={defaults.lopti_order!r}). Lopti trains each "
        "generation batch twice, so it makes two optimizer steps where GRPO makes one: max_steps, the learning-rate "
        "schedule, save_steps and logging_steps now count twice per generation batch, and max_steps buys half the "
        "rollouts. Pass a trl_lopti.LoptiGRPOConfig to choose these values (lopti_threshold=None and "
        "advantage_reweighting_alpha=0 give plain GRPO).",
        UserWarning,
        stacklevel=3,
    )
    return LoptiGRPOConfig(**values)


class LoptiGRPOTrainer(GRPOTrainer):
    """
    TRL's `GRPOTrainer` with Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti), arXiv 2505.12929.

    Same constructor and arguments as `GRPOTrainer`. `args` should be a [`LoptiGRPOConfig`]; a plain `GRPOConfig`
    is upgraded with the paper's defaults (`advantage_reweighting_alpha=0.3`, `lopti_threshold=0.5`), with a warning.

    - AR replaces each completion's advantage `A(i)` by the token-level `(alpha * pi_old(i, t) + 1 - alpha) * A(i)`.
      The KL penalty is not reweighted.
    - Lopti splits the completion tokens of each generation batch once by `pi_old < lopti_threshold` and trains the
      batch once per token group: first only the low tokens carry gradient, then only the high ones, from the
      parameters the first pass produced and with importance ratios against the same `pi_old`. In a pass every value
      of the loss is what plain GRPO computes; only the gradient through the inactive tokens' log-probabilities and
      entropies is cut, which isolates the groups for every loss type and importance-sampling level. The router's
      auxiliary loss (MoE models), not a per-token term, gets its gradient in the first pass only.
    - `advantage_estimator="reinforce_plus_plus"` replaces TRL's group-relative advantages by REINFORCE++'s.

    The schedule, its cost and what `max_steps` counts: README, section "The Lopti schedule".

    Logged metrics (prefix `lopti/`), once per generation batch: `lopti/low_token_share` (share of the batch's
    completion tokens with `pi_old < eta`; eta = 0.5 when Lopti is off), `lopti/ar_weight_mean` (mean AR weight over
    them, with AR on); once per pass: `lopti/loss_low_pass`, `lopti/loss_high_pass` (TRL's loss, whose value is the
    plain GRPO loss at the parameters of that pass). Completions (`log_completions`) are logged once per generation
    batch.
    """

    _tag_names = ["trl", "grpo", "lopti"]
    _name = "Lopti-GRPO"
    _paper = {
        "title": "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs",
        "id": "2505.12929",
        "citation": LOPTI_PAPER_CITATION + "\n\n" + GRPOTrainer._paper["citation"],
    }

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *extra_args, **kwargs):
        args = as_lopti_config(args, model)
        super().__init__(model, reward_funcs, args, *extra_args, **kwargs)
        self.advantage_reweighting_alpha = args.advantage_reweighting_alpha
        self.lopti_threshold = args.lopti_threshold
        self.lopti_pass_order = args.lopti_pass_order
        self.advantage_estimator = args.advantage_estimator
        self._name = describe_method(args)
        self._token_weighting: _TokenWeighting | None = None  # set for the duration of one compute_loss call
        self._generation_batch_token_totals: torch.Tensor | None = None  # metric sums of the current batch
        self._generation_batch_rewards: torch.Tensor | None = None  # REINFORCE++: rewards of every process
        self._generation_batches_seen = 0
        self._completions_logged_for = -1

    # ------------------------------------------------------------------------------------------------ schedule
    @property
    def lopti_pass_micro_steps(self) -> int:
        """Micro-steps in one pass: the schedule plain GRPO runs on one generation batch."""
        return self.args.steps_per_generation * self.num_iterations

    def lopti_pass_index(self, micro_step: int | None = None) -> int:
        """
        Which pass over its generation batch a training micro-step belongs to.

        Args:
            micro_step (`int` or `None`, *optional*):
                TRL's micro-step counter; defaults to the current one (`self._step`).

        Returns:
            `int`: 0 for the first pass, 1 for the second (always 0 without Lopti).
        """
        micro_step = self._step if micro_step is None else micro_step
        cycle_micro_steps = len(self.lopti_pass_order) * self.lopti_pass_micro_steps
        return (micro_step % cycle_micro_steps) // self.lopti_pass_micro_steps

    def lopti_token_group(self) -> str | None:
        """The token group that carries gradient in the current training micro-step (`None` without Lopti)."""
        return self.lopti_pass_order[self.lopti_pass_index()]

    def get_train_dataloader(self):
        # One repeat of TRL's schedule per pass: an epoch still covers every prompt once.
        with _temporarily_set(self, "num_iterations", len(self.lopti_pass_order) * self.num_iterations):
            return super().get_train_dataloader()

    def _prepare_inputs(self, generation_batch):
        if not self.model.training or self.lopti_pass_index() == 0:
            return super()._prepare_inputs(generation_batch)
        # A later pass replays the generation batch of the first (TRL's `_step` keeps counting, so it does not
        # generate here: it generates again at the start of the next cycle).
        buffered = self._buffered_inputs[self._step % self.args.steps_per_generation]
        if "old_per_token_logps" not in buffered and CAPTURED_OLD_LOGPS_KEY not in buffered:
            raise RuntimeError("Lopti second pass without the pi_old of its first pass; please report this bug.")
        return buffered

    # ------------------------------------------------------------------------------------------------ advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.advantage_estimator == "reinforce_plus_plus":
            self._generation_batch_rewards = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self._generation_batches_seen += 1
        if self.advantage_estimator == "reinforce_plus_plus":
            rewards_per_func, self._generation_batch_rewards = self._generation_batch_rewards, None
            output["advantages"] = self._reinforce_plus_plus_advantages(rewards_per_func, output)
        return output

    def _reinforce_plus_plus_advantages(self, rewards_per_func: torch.Tensor, output: dict) -> torch.Tensor:
        """REINFORCE++ advantages of this process's completions, whitened over the whole generation batch."""
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # unscorable, as TRL marks them
        lengths = self.accelerator.gather(_loss_mask(output).sum(dim=1))  # process order, as the rewards
        advantages = reinforce_plus_plus_advantages(rewards, lengths)
        # the completions table shows the advantages trained on
        logged = self._logs["advantages"]
        for _ in range(min(len(advantages), len(logged))):
            logged.pop()
        logged.extend(advantages.tolist())
        local = len(output["completion_mask"])
        start = self.accelerator.process_index * local
        return advantages[start : start + local].to(output["completion_mask"].device)

    # ------------------------------------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        token_group = self.lopti_token_group() if mode == "train" else None
        first_pass = mode == "eval" or self.lopti_pass_index() == 0
        if token_group is not None and self._pass_has_no_active_token(token_group):
            if first_pass:  # ruled out before it ran, so pi_old is known: the batch's metrics still count
                mask = _loss_mask(inputs)
                low_mask, weights = self._token_split(inputs["old_per_token_logps"], mask)
                self._record_generation_batch_metrics(mode, low_mask, weights, mask)
            self._log_pass_loss(token_group, torch.zeros((), device=self.accelerator.device))
            # A leaf with no graph: backward touches no parameter, gradients stay None and the optimizer skips
            # every parameter.
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        loss_inputs = dict(inputs)
        if "old_per_token_logps" not in loss_inputs and CAPTURED_OLD_LOGPS_KEY in inputs and not first_pass:
            # A later pass of an on-policy run: the ratio is against the pi_old captured in the first pass.
            loss_inputs["old_per_token_logps"] = inputs[CAPTURED_OLD_LOGPS_KEY]
        weighting = _TokenWeighting(loss_inputs, inputs, token_group, first_pass, mode)
        with self._weighting_of_next_policy_forward(weighting):
            loss = super().compute_loss(model, loss_inputs, return_outputs, num_items_in_batch)
        if not weighting.applied:
            raise RuntimeError(
                "GRPOTrainer._compute_loss no longer calls _get_per_token_logps_and_entropies: this TRL version is "
                "not supported by trl_lopti."
            )
        if token_group is not None:
            self._log_pass_loss(token_group, loss.detach())
        return loss

    @contextlib.contextmanager
    def _weighting_of_next_policy_forward(self, weighting: _TokenWeighting):
        self._token_weighting = weighting
        try:
            yield
        finally:
            self._token_weighting = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        per_token_logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        weighting, self._token_weighting = self._token_weighting, None  # only the policy forward of the loss
        if weighting is not None:
            weighting.applied = True
            per_token_logps, entropies, aux_loss = self._apply_token_weighting(
                weighting, per_token_logps, entropies, aux_loss
            )
        return per_token_logps, entropies, aux_loss

    def _apply_token_weighting(self, weighting: _TokenWeighting, per_token_logps, entropies, aux_loss):
        """Rewrites the advantages TRL is about to read (AR) and isolates the active tokens' gradients (Lopti)."""
        loss_inputs = weighting.loss_inputs
        mask = _loss_mask(loss_inputs)
        old_per_token_logps = loss_inputs.get("old_per_token_logps")
        if old_per_token_logps is None:
            # On-policy: TRL itself uses these detached log-probs as pi_old (its forward is at the behaviour policy).
            old_per_token_logps = per_token_logps.detach()
            if weighting.token_group is not None:
                weighting.buffered_inputs[CAPTURED_OLD_LOGPS_KEY] = old_per_token_logps

        low_mask, weights = self._token_split(old_per_token_logps, mask)
        if weights is not None:  # AR: A'(i, t) = (alpha * pi_old(i, t) + 1 - alpha) * A(i)
            advantages = loss_inputs["advantages"]
            loss_inputs["advantages"] = token_level_advantages(advantages, weights.size(1)) * weights
        if weighting.token_group is not None:
            active_mask = token_group_mask(low_mask, mask, weighting.token_group)
            per_token_logps = isolate_token_gradients(per_token_logps, active_mask)
            if entropies is not None:
                entropies = isolate_token_gradients(entropies, active_mask)
            if aux_loss is not None and not weighting.first_pass:
                aux_loss = aux_loss.detach()
        if weighting.first_pass:
            self._record_generation_batch_metrics(weighting.mode, low_mask, weights, mask)
        return per_token_logps, entropies, aux_loss

    def _token_split(self, old_per_token_logps: torch.Tensor, mask: torch.Tensor):
        """The low-probability mask (the Lopti split) and the AR weights (`None` without AR) of a micro-batch."""
        low_mask = low_probability_token_mask(
            old_per_token_logps, mask, self.lopti_threshold or UNSPLIT_REPORTING_THRESHOLD
        )
        weights = None
        if self.advantage_reweighting_alpha != 0.0:
            weights = advantage_reweighting_weights(old_per_token_logps, self.advantage_reweighting_alpha)
        return low_mask, weights

    # ------------------------------------------------------------------------------------------------ metrics
    def _record_generation_batch_metrics(self, mode: str, low_mask, weights, mask) -> None:
        """Sums the token metrics over the first sweep of a generation batch; logs them once, at its last micro-step."""
        mask = mask.float()
        weight_sum = (weights.float() * mask).sum() if weights is not None else mask.new_zeros(())
        totals = torch.stack([(low_mask.float() * mask).sum(), weight_sum, mask.sum()])
        if mode == "train":
            sweep_step = self._step % self.lopti_pass_micro_steps
            if sweep_step >= self.args.steps_per_generation:  # a later iteration (num_iterations > 1)
                return
            if sweep_step == 0 or self._generation_batch_token_totals is None:
                self._generation_batch_token_totals = torch.zeros_like(totals)
            self._generation_batch_token_totals += totals
            if sweep_step != self.args.steps_per_generation - 1:
                return
            totals, self._generation_batch_token_totals = self._generation_batch_token_totals, None
        totals = self.accelerator.reduce(totals, reduction="sum")
        if totals[2] > 0:
            self._metrics[mode]["lopti/low_token_share"].append((totals[0] / totals[2]).item())
            if weights is not None:
                self._metrics[mode]["lopti/ar_weight_mean"].append((totals[1] / totals[2]).item())

    def _log_pass_loss(self, token_group: str, loss: torch.Tensor) -> None:
        # The loss TRL returns is one micro-step's share of its optimizer step; scaled back to a per-step value.
        per_step_loss = loss * self.current_gradient_accumulation_steps
        value = self.accelerator.gather(per_step_loss.reshape(1)).mean().item()
        self._metrics["train"][f"lopti/loss_{token_group}_pass"].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # TRL writes the completions table at every log; a generation batch trained over several optimizer steps
        # (Lopti's passes, steps_per_generation > gradient_accumulation_steps) would be written once per step.
        fresh = self._completions_logged_for != self._generation_batches_seen
        with _temporarily_set(self, "log_completions", self.log_completions and fresh):
            if self.log_completions:
                self._completions_logged_for = self._generation_batches_seen
            super().log(logs, start_time)

    # ------------------------------------------------------------------------------------------------ helpers
    def _pass_has_no_active_token(self, token_group: str) -> bool:
        """Whether the current pass has no active token on any process (False where not known before it runs)."""
        if self.is_deepspeed_enabled or not self._buffered_inputs:
            return False
        active_tokens = 0
        for micro_batch in self._buffered_inputs:
            old_per_token_logps = micro_batch.get("old_per_token_logps", micro_batch.get(CAPTURED_OLD_LOGPS_KEY))
            if old_per_token_logps is None:
                return False  # on-policy first pass: pi_old comes from this pass's own forward
            mask = _loss_mask(micro_batch)
            active = lopti_active_token_mask(old_per_token_logps, mask, self.lopti_threshold, token_group)
            active_tokens += int(active.sum())
        total = self.accelerator.reduce(torch.tensor(active_tokens, device=self.accelerator.device), reduction="sum")
        return int(total) == 0


def describe_method(config: LoptiGRPOConfig) -> str:
    """
    The method a configuration trains with, in words (the model card's "trained with").

    Args:
        config (`LoptiGRPOConfig`):
            The configuration.

    Returns:
        `str`: For example `"GRPO with Advantage Reweighting (alpha=0.3) and Lopti (eta=0.5, low tokens first)"`.
    """
    base = {"grpo": "GRPO", "reinforce_plus_plus": "REINFORCE++"}[config.advantage_estimator]
    parts = []
    if config.advantage_reweighting_alpha != 0.0:
        parts.append(f"Advantage Reweighting (alpha={config.advantage_reweighting_alpha:g})")
    if config.lopti_threshold is not None:
        order = "low tokens first" if config.lopti_order == "low_first" else "high tokens first, the paper's ablation"
        parts.append(f"Low-Probability Token Isolation (Lopti, eta={config.lopti_threshold:g}, {order})")
    return f"{base} with {' and '.join(parts)}" if parts else base


def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """The tokens TRL's loss sums over: completion tokens, less tool output where TRL masks it."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


@contextlib.contextmanager
def _temporarily_set(obj: Any, name: str, value: Any):
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)


__all__ = ["LoptiGRPOTrainer", "as_lopti_config", "describe_method"]
