"""`LoptiRLOOTrainer`: TRL's `RLOOTrainer` with Advantage Reweighting and Low-Probability Token Isolation.

The math is in `trl_lopti/core_algos.py`, the mechanism shared with GRPO (schedule, split, isolation,
metrics, checkpoints, the runtime checks) in `trl_lopti/lopti_mixin.py`; this file is RLOO's plumbing. RLOO's
loss is sequence-level: the sum of a completion's token log-probabilities against pi_old's sum, one clipped
ratio and one advantage per sequence (its KL is a reward penalty, computed before the leave-one-out
baseline).

- pi_old: RLOO computes it per token at every generation, on-policy too, and keeps only each sequence's sum
  (fact R1); the trainer keeps the per-token values, so neither AR, Lopti nor the quantile rule costs a
  forward pass.
- AR in its general form ([`~trl_lopti.core_algos.reweight_token_gradients`]): the gradient through each
  token's log-probability is scaled by `w = alpha * pi_old + 1 - alpha`, and every value of the loss stays
  RLOO's. Where a sequence is not clipped, token t then gets gradient `ratio * A * w(t)`; nothing is
  reweighted twice (the KL is in the reward).
- Lopti: isolation in its general form is exact for the sequence ratio: at equal parameters, low pass + high
  pass = plain RLOO's gradient.

The TRL facts it relies on besides the shared ones are R1-R2, stated in `trl_lopti/trl_contract.py` and
checked here.
"""

from typing import Any

import torch

# Checks the TRL version before TRL is imported.
from .trl_contract import RLOO_GENERATION, RLOO_LOSS, broken_fact


# isort: split
from trl import RLOOTrainer

from .config import LoptiRLOOConfig
from .lopti_mixin import LoptiTrainerMixin


class LoptiRLOOTrainer(LoptiTrainerMixin, RLOOTrainer):
    """
    TRL's `RLOOTrainer` with Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti), arXiv
    2505.12929.

    Same constructor and arguments as `RLOOTrainer`. `args` should be a [`LoptiRLOOConfig`]; a plain
    `RLOOConfig` is upgraded with the paper's defaults (`advantage_reweighting_alpha=0.3`,
    `lopti_threshold=0.5`), with a warning.

    - AR: the gradient through each completion token's log-probability is scaled by
      `alpha * pi_old(i, t) + 1 - alpha`; every value of RLOO's loss (ratio, clipping, advantage) is
      unchanged.
    - Lopti: the completion tokens of each generation batch are split once by `pi_old < eta`
      (`lopti_threshold`, or the `lopti_quantile` quantile of the batch's pi_old), and the batch is trained
      once per group, low tokens first, the second pass from the first's parameters and against the same
      pi_old; in a pass gradient flows only through the active tokens. An empty pass is an ordinary optimizer
      step with zero gradient; a MoE router's auxiliary loss is trained in the first pass only.
    - A checkpoint taken between the passes keeps its generation batch; resuming continues the schedule
      there.

    [Metrics][lopti-metrics] and completions table as [`LoptiGRPOTrainer`]'s. No forward pass is added: RLOO
    computes pi_old anyway.
    """

    config_class = LoptiRLOOConfig
    trl_trainer_class = RLOOTrainer
    contract_name = "rloo"
    loss_is_scaled_for_accumulation = False

    def __init__(self, model, reward_funcs, args=None, *extra_args, **kwargs):
        # TRL's RLOOTrainer requires its reward functions, where GRPOTrainer's default to None: so does this one.
        super().__init__(model, reward_funcs, args, *extra_args, **kwargs)

    def old_per_token_logps_at_generation(
        self, batch: dict[str, Any], scoring_logps: list[torch.Tensor]
    ) -> torch.Tensor:
        # Fact R1: the first forward of the generation is pi_old, and `old_logps` is its masked sum. Summed
        # in another order, T terms differ by at most (T - 1) * eps * sum |terms| (the bound of recursive
        # summation): the tolerance. Any other forward's log-probabilities (the reference model's, once the
        # policy moved) lie beyond.
        old_per_token_logps = scoring_logps[0] if scoring_logps else None
        if old_per_token_logps is None:
            raise broken_fact(
                RLOO_GENERATION, "RLOOTrainer ran no log-prob forward while scoring the batch", type(self)
            )
        mask = batch["completion_mask"]
        terms = old_per_token_logps * mask
        bound = (mask.size(1) - 1) * torch.finfo(terms.dtype).eps * terms.abs().sum(1)
        difference = (terms.sum(1) - batch["old_logps"]).abs()
        if not torch.all((difference <= bound) | (difference.isnan() & batch["old_logps"].isnan())):
            raise broken_fact(
                RLOO_GENERATION,
                "the masked sum of its first log-prob forward is not the old_logps it returned",
                type(self),
            )
        # Fact R2: RLOO's loss sums over completion_mask alone, so a tool_mask, which the split would read,
        # it ignores.
        if batch.get("tool_mask") is not None:
            raise broken_fact(
                RLOO_LOSS,
                "RLOOTrainer returned a tool_mask, which its loss ignores and the split would read",
                type(self),
            )
        # Kept per token beside RLOO's sum, which its loss reads: a batch split again (`trl-lopti check`) needs it.
        batch["old_per_token_logps"] = old_per_token_logps
        return old_per_token_logps


__all__ = ["LoptiRLOOTrainer"]
