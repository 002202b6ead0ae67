"""`LoptiGRPOTrainer`: TRL's `GRPOTrainer` with Advantage Reweighting and Low-Probability Token Isolation.

The math is in `trl_lopti/core_algos.py`, the mechanism shared with RLOO (schedule, split, isolation, metrics,
checkpoints) in `trl_lopti/lopti_mixin.py`; this file is GRPO's plumbing. TRL computes every loss, KL, clipping,
importance-sampling and normalisation term itself; AR changes, per token, the advantage TRL's loss reads.

- pi_old: TRL's `old_per_token_logps` where TRL computes it at generation (off-policy schedules, vLLM importance
  sampling: fact G2), else the first pass's own forward (on-policy: no extra forward).
- AR: token-level advantages `A'(i, t)` (B, T) in place of TRL's (B,) ones, which TRL's loss accepts and reads after its
  policy forward (fact G1); the KL and entropy terms are untouched.

The TRL facts it relies on besides the shared ones (S1-S5, `trl_lopti/lopti_mixin.py`), numbered once in
`trl_lopti/_compat.py` (`TRL_FACTS`) and pinned by `tests/test_trl_contract.py`:

- G1. Loss. `_compute_loss(model, inputs)` reads `inputs["advantages"]` (token-level (B, T) accepted) and
  `inputs.get("old_per_token_logps")` (absent: the forward's own detached output) only after its policy forward, and
  returns the micro-step's share of its optimizer step's loss.
- G2. Generation. `_generate_and_score_completions` returns `old_per_token_logps` exactly when TRL needs pi_old
  (off-policy schedules, vLLM importance sampling).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from . import _compat  # noqa: F401  (checks the TRL version before TRL is imported)


# isort: split
from trl import GRPOTrainer

from .config import LoptiGRPOConfig
from .core_algos import reweight_advantages
from .lopti_mixin import AR_ADVANTAGES_KEY, LoptiTrainerMixin, LossCall, lopti_paper
from .reinforce_plus_plus import ReinforcePlusPlusMixin


class LoptiGRPOTrainer(LoptiTrainerMixin, ReinforcePlusPlusMixin, GRPOTrainer):
    """
    TRL's `GRPOTrainer` with Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti), arXiv 2505.12929.

    Same constructor and arguments as `GRPOTrainer`. `args` should be a [`LoptiGRPOConfig`]; a plain `GRPOConfig`
    is upgraded with the paper's defaults (`advantage_reweighting_alpha=0.3`, `lopti_threshold=0.5`), with a warning.

    - AR: each completion's advantage `A(i)` becomes `(alpha * pi_old(i, t) + 1 - alpha) * A(i)` (not the KL).
    - Lopti: the completion tokens of each generation batch are split once by `pi_old < eta` (`lopti_threshold`, or
      the `lopti_quantile` quantile of the batch's pi_old), and the batch is trained once per group, low tokens first,
      the second pass from the first's parameters and against the same pi_old. In a pass every value of the loss is
      plain GRPO's; only gradient through inactive tokens' log-probabilities and entropies is cut, which isolates the
      groups for every loss type. An empty pass is an ordinary optimizer step with zero gradient (as the authors
      run it); a MoE router's auxiliary loss is trained in the first pass only.
    - `advantage_estimator="reinforce_plus_plus"`: REINFORCE++ advantages ([`~trl_lopti.reinforce_plus_plus`]).
    - A checkpoint taken between the passes keeps its generation batch; resuming continues the schedule there.

    Metrics (`lopti/low_token_share`, `ar_weight_mean`, `threshold` per generation batch, `loss_low_pass`,
    `loss_high_pass` per pass): docs/trainers/grpo.md, "Metrics". Completions are logged once per generation batch.
    """

    config_class = LoptiGRPOConfig
    trl_trainer_class = GRPOTrainer
    loss_is_scaled_for_accumulation = True  # fact G1
    _tag_names: ClassVar[list[str]] = ["trl", "grpo", "lopti"]
    _name = "Lopti-GRPO"
    _paper: ClassVar[dict[str, str]] = lopti_paper(GRPOTrainer)

    def old_per_token_logps_at_generation(self, batch: dict[str, Any], generation_logps: list) -> Any:
        # Fact G2: TRL's own pi_old where it needs one; on-policy, the first pass's forward gives it (no extra forward)
        return batch.get("old_per_token_logps")

    def store_advantage_reweighting(self, batch: dict[str, Any], old_per_token_logps: torch.Tensor) -> None:
        # A'(i, t) = (alpha * pi_old(i, t) + 1 - alpha) * A(i), under its own key: TRL's advantages stay in the batch
        alpha = self.args.advantage_reweighting_alpha
        batch[AR_ADVANTAGES_KEY] = reweight_advantages(batch["advantages"], old_per_token_logps, alpha)

    def apply_advantage_reweighting(self, call: LossCall, per_token_logps: torch.Tensor) -> torch.Tensor:
        # Fact G1: TRL's loss reads its (token-level) advantages after this forward
        call.loss_inputs["advantages"] = call.batch[AR_ADVANTAGES_KEY]
        return per_token_logps


__all__ = ["LoptiGRPOTrainer"]
