"""`LoptiGRPOTrainer`: TRL's `GRPOTrainer` with Advantage Reweighting and Low-Probability Token Isolation.

The math is in `trl_lopti/core_algos.py`, the mechanism shared with RLOO (schedule, split, isolation,
metrics, checkpoints, the runtime checks) in `trl_lopti/lopti_mixin.py`; this file is GRPO's plumbing. TRL
computes every loss, KL, clipping, importance-sampling and normalisation term itself.

- pi_old: TRL's `old_per_token_logps`, which TRL computes at generation whenever a generation batch spans
  several optimizer steps (fact G2): always under Lopti, whose passes do. On-policy, AR alone takes it from the
  loss forward's own detached output (no extra forward), except with a KL term in TRL's own loss, where it costs
  one no-grad forward per generation batch.
- AR in TRL's own loss where each token has its own importance ratio (`importance_sampling_level="token"`):
  token-level advantages `A'(i, t) = w(i, t) * A(i)` (B, T) in place of TRL's (B,) ones, handed to the loss
  in its inputs, which it accepts (fact G1); the KL and entropy terms are untouched. Where the
  tokens of a sequence share one ratio (`"sequence"`: GSPO, and LUSPO as TRL recommends it), the ratio would
  average the weights of a sequence's tokens, and a subclass's loss (GMPO's, a user's) may read the
  advantages as (B,): there AR takes its general form ([`~trl_lopti.core_algos.reweight_token_gradients`]):
  the gradient through each token's log-probability is scaled by `w(i, t)` and every value of the loss is
  unchanged. That form would reweight the KL term's gradient too, so it is refused with `beta != 0`.

The TRL facts it relies on besides the shared ones are G1-G3, stated in `trl_lopti/trl_contract.py`.
"""

from typing import Any

import torch

# Checks the TRL version before TRL is imported.
from .trl_contract import GRPO_GENERATION, broken_fact


# isort: split
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from .config import LoptiArguments, LoptiGRPOConfig
from .lopti_mixin import LoptiTrainerMixin
from .reinforce_plus_plus import ReinforcePlusPlusMixin
from .utils import defining_class, trl_completion_logps


class LoptiGRPOTrainer(LoptiTrainerMixin, ReinforcePlusPlusMixin, GRPOTrainer):
    """
    TRL's `GRPOTrainer` with Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti), arXiv
    2505.12929.

    Same constructor and arguments as `GRPOTrainer`. `args` should be a [`LoptiGRPOConfig`]; a plain
    `GRPOConfig` is upgraded with the paper's defaults (`advantage_reweighting_alpha=0.3`,
    `lopti_threshold=0.5`), with a warning.

    - AR: each completion's advantage `A(i)` becomes `(alpha * pi_old(i, t) + 1 - alpha) * A(i)`
      (not the KL); with a sequence-level importance ratio, the gradient through each token's log-probability
      is scaled by that weight.
    - Lopti: the completion tokens of each generation batch are split once by `pi_old < eta`
      (`lopti_threshold`, or the `lopti_quantile` quantile of the batch's pi_old), and the batch is trained
      once per group, low tokens first, the second pass from the first's parameters and against the same
      pi_old. In a pass every value of the loss is plain GRPO's; only gradient through inactive tokens'
      log-probabilities and entropies is cut, which isolates the groups for every loss type. An empty pass is
      an ordinary optimizer step with zero gradient (as the authors run it); a MoE router's auxiliary loss is
      trained in the first pass only.
    - `advantage_estimator="reinforce_plus_plus"`: REINFORCE++ advantages
      ([`~trl_lopti.reinforce_plus_plus`]).
    - A checkpoint taken between the passes keeps its generation batch; resuming continues the schedule
      there.

    [Metrics][lopti-metrics] (`lopti/low_token_share`, `ar_weight_mean`, `threshold` per generation batch, on
    the log row of its reward; `loss_low_pass`, `loss_high_pass` per pass; `eval_lopti/*` at each
    evaluation). The completions table is TRL's, written at every log.
    """

    config_class = LoptiGRPOConfig
    trl_trainer_class = GRPOTrainer
    contract_name = "grpo"
    loss_is_scaled_for_accumulation = True

    @classmethod
    def advantage_reweighting_form(cls, args: LoptiArguments) -> str:
        # Token-level advantages only in TRL's own token-level loss, which weights each token by its own (fact
        # G1). A loss of a subclass (GMPOTrainer's, a user's) may read them as (B,), and where B equals T a (B, T)
        # tensor would broadcast there silently.
        loss_class = defining_class(cls, "_compute_loss")
        compute_class = defining_class(cls, "compute_loss")
        own_loss = loss_class is GRPOTrainer and compute_class is GRPOTrainer
        if own_loss and args.importance_sampling_level == "token":
            return "advantages"
        # The general form scales the gradient through every term of the loss that reads the log-probabilities: a
        # KL term too, in a loss of a subclass as in TRL's own at sequence level.
        if args.advantage_reweighting_enabled and args.beta != 0.0:
            owner = loss_class if loss_class is not GRPOTrainer else compute_class
            method = "_compute_loss" if owner is loss_class else "compute_loss"
            where = f"{owner.__name__}.{method} (in {owner.__module__}) is not TRL's token-level GRPO loss"
            fix = "Set beta=0.0, or advantage_reweighting_alpha=0.0 (Lopti alone is exact with any beta)"
            if own_loss:
                where = "importance_sampling_level='sequence' gives the tokens of a sequence one importance ratio"
                fix = "Set beta=0.0, importance_sampling_level='token', or advantage_reweighting_alpha=0.0"
            raise ValueError(
                f"{cls.__name__}: advantage_reweighting_alpha={args.advantage_reweighting_alpha:g} with "
                f"beta={args.beta:g}. {where}, so Advantage Reweighting takes its general form there: it scales the "
                "gradient through each token's log-probability, and so would scale the gradient of the KL term that "
                f"beta adds too, which AR leaves alone. {fix}"
            )
        return "gradients"

    def old_per_token_logps_at_generation(
        self, batch: dict[str, Any], scoring_logps: list[torch.Tensor]
    ) -> torch.Tensor | None:
        old_per_token_logps = batch.get("old_per_token_logps")
        # Fact G2: TRL computes pi_old where the generation batch spans several optimizer steps, as each of
        # Lopti's does (`self.num_iterations` counts its passes).
        generate_every = self.args.steps_per_generation * self.num_iterations
        if old_per_token_logps is None and self.args.gradient_accumulation_steps % generate_every:
            saw = (
                f"no old_per_token_logps for a generation batch trained over {generate_every} micro-steps, "
                f"{self.args.gradient_accumulation_steps} per optimizer step"
            )
            raise broken_fact(GRPO_GENERATION, saw, type(self))
        # On-policy, AR's token-level advantages need pi_old before the loss runs: one no-grad forward, as TRL's.
        placed_before_the_loss = self._lopti.advantage_reweighting_form == "advantages" and self.beta != 0.0
        reweighted = self.model.training and self.args.advantage_reweighting_enabled
        if old_per_token_logps is None and reweighted and placed_before_the_loss:
            batch_size = self.args.per_device_train_batch_size
            checkpointing = self.args.gradient_checkpointing_kwargs
            with torch.no_grad(), disable_gradient_checkpointing(self.model, checkpointing):
                old_per_token_logps = trl_completion_logps(self, batch, batch_size=batch_size)[0]
        return old_per_token_logps


__all__ = ["LoptiGRPOTrainer"]
