"""`LoptiGRPOTrainer`: TRL's `GRPOTrainer` with Advantage Reweighting and Low-Probability Token Isolation.

The math is in `trl_lopti/core_algos.py`, the mechanism shared with RLOO (schedule, split, isolation,
metrics, checkpoints, the runtime checks) in `trl_lopti/lopti_mixin.py`; this file is GRPO's plumbing. TRL
computes every loss, KL, clipping, importance-sampling and normalisation term itself.

- pi_old: TRL's `old_per_token_logps` where TRL computes it at generation (off-policy schedules, vLLM
  importance sampling: fact G2), else the first pass's own forward (on-policy: no extra forward).
- AR in TRL's own loss where each token has its own importance ratio (`importance_sampling_level="token"`):
  token-level advantages `A'(i, t) = w(i, t) * A(i)` (B, T) in place of TRL's (B,) ones, which TRL's loss
  accepts and reads after its policy forward (fact G1); the KL and entropy terms are untouched. Where the
  tokens of a sequence share one ratio (`"sequence"`: GSPO, and LUSPO as TRL recommends it), the ratio would
  average the weights of a sequence's tokens, and a subclass's loss (GMPO's, a user's) may read the
  advantages as (B,): there AR takes its general form ([`~trl_lopti.core_algos.reweight_token_gradients`]):
  the gradient through each token's log-probability is scaled by `w(i, t)` and every value of the loss is
  unchanged. That form would reweight the KL term's gradient too, so it is refused with `beta != 0`.

The TRL facts it relies on besides the shared ones are G1-G3, stated in `trl_lopti/trl_contract.py`.
"""

from typing import Any

# Checks the TRL version before TRL is imported.
from .trl_contract import GRPO_LOSS


# isort: split
from trl import GRPOTrainer

from .config import LoptiArguments, LoptiGRPOConfig
from .lopti_mixin import LoptiTrainerMixin
from .reinforce_plus_plus import ReinforcePlusPlusMixin
from .utils import defining_class


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
    placement_fact = GRPO_LOSS

    def advantage_reweighting_form(self, args: LoptiArguments) -> str:
        # Token-level advantages only in TRL's own token-level loss, which reads them per token (fact G1). A loss
        # of a subclass (GMPOTrainer's, a user's) may read them as (B,), and where B equals T a (B, T) tensor
        # would broadcast there silently.
        loss_class = defining_class(type(self), "_compute_loss")
        compute_class = defining_class(type(self), "compute_loss")
        own_loss = loss_class is GRPOTrainer and compute_class is GRPOTrainer
        if own_loss and args.importance_sampling_level == "token":
            return "advantages"
        # The general form scales the gradient through every term of the loss that reads the log-probabilities.
        if not own_loss and args.advantage_reweighting_enabled and args.beta != 0.0:
            owner = loss_class if loss_class is not GRPOTrainer else compute_class
            method = "_compute_loss" if owner is loss_class else "compute_loss"
            raise ValueError(
                f"{type(self).__name__}: advantage_reweighting_alpha={args.advantage_reweighting_alpha:g} with "
                f"beta={args.beta:g}. {owner.__name__}.{method} (in {owner.__module__}) is not TRL's token-level "
                "GRPO loss, so Advantage Reweighting takes its general form there: it scales the gradient through "
                "each token's log-probability, and so would scale the gradient of the KL term that beta adds too, "
                "which AR leaves alone. Set beta=0.0, or advantage_reweighting_alpha=0.0 (Lopti alone is exact with "
                "any beta)"
            )
        return "gradients"

    def old_per_token_logps_at_generation(self, batch: dict[str, Any], generation_logps: list) -> Any:
        # Fact G2: TRL's own pi_old where it needs one. On-policy, the first pass's forward gives it: no
        # extra forward.
        return batch.get("old_per_token_logps")


__all__ = ["LoptiGRPOTrainer"]
