"""`LoptiGRPOTrainer`: TRL's `GRPOTrainer` with Advantage Reweighting and Low-Probability Token Isolation.

The math is in `trl_lopti/core_algos.py`, the mechanism shared with RLOO (schedule, split, isolation,
metrics, checkpoints, the runtime checks) in `trl_lopti/lopti_mixin.py`; this file is GRPO's plumbing. TRL
computes every loss, KL, clipping, importance-sampling and normalisation term itself.

- pi_old: TRL's `old_per_token_logps` where TRL computes it at generation (off-policy schedules, vLLM
  importance sampling: fact G2), else the first pass's own forward (on-policy: no extra forward).
- AR where each token has its own importance ratio (`importance_sampling_level="token"`): token-level
  advantages `A'(i, t) = w(i, t) * A(i)` (B, T) in place of TRL's (B,) ones, which TRL's loss accepts and
  reads after its policy forward (fact G1); the KL and entropy terms are untouched. Where the tokens of a
  sequence share one ratio (`"sequence"`: GSPO, and LUSPO as TRL recommends it), the ratio would average the
  weights of a sequence's tokens, so AR takes its general form
  ([`~trl_lopti.core_algos.reweight_token_gradients`]): the gradient through each token's log-probability is
  scaled by `w(i, t)` and every value of the loss is unchanged. That form would reweight the KL term's
  gradient too, so `LoptiGRPOConfig` refuses it with `beta != 0`.

The TRL facts it relies on besides the shared ones are G1-G3, stated in `trl_lopti/trl_contract.py`.
"""

from typing import Any, ClassVar

import torch

# Checks the TRL version before TRL is imported.
from .trl_contract import GRPO_LOSS


# isort: split
from trl import GRPOTrainer

from .config import LoptiGRPOConfig
from .core_algos import reweight_token_gradients, token_level_advantages
from .lopti_mixin import AR_WEIGHTS_KEY, LoptiTrainerMixin, LossCall, lopti_paper
from .reinforce_plus_plus import ReinforcePlusPlusMixin


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
    _tag_names: ClassVar[list[str]] = ["trl", "grpo", "lopti"]
    _name = "Lopti-GRPO"
    _paper: ClassVar[dict[str, str]] = lopti_paper(GRPOTrainer)

    def old_per_token_logps_at_generation(self, batch: dict[str, Any], generation_logps: list) -> Any:
        # Fact G2: TRL's own pi_old where it needs one. On-policy, the first pass's forward gives it: no
        # extra forward.
        return batch.get("old_per_token_logps")

    def apply_advantage_reweighting(self, call: LossCall, per_token_logps: torch.Tensor) -> torch.Tensor:
        weights = call.batch[AR_WEIGHTS_KEY]
        # Where a sequence's tokens share one ratio, AR takes its general form.
        if self.args.importance_sampling_level == "sequence":
            return reweight_token_gradients(per_token_logps, weights)
        # A'(i, t) = w(i, t) * A(i) in what the loss reads, which it reads after this forward (fact G1).
        advantages = token_level_advantages(call.batch["advantages"], weights.size(1)) * weights
        self.place_loss_input(call, "advantages", advantages)
        return per_token_logps


__all__ = ["LoptiGRPOTrainer"]
