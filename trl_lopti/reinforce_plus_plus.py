"""REINFORCE++, the paper's second base algorithm, as one advantage estimator beside TRL's group-relative
one.

`ReinforcePlusPlusMixin`, a base class of `LoptiGRPOTrainer`, acts only with
`advantage_estimator= "reinforce_plus_plus"`: it replaces each generation batch's advantages by
`core_algos.reinforce_plus_plus_advantages` of its rewards, before AR and Lopti read them. Deleting it (and
the config value) changes nothing else.

It relies on fact G3 (`_calculate_rewards`, stated in `trl_lopti/trl_contract.py`), checked here at every
generation batch. It shows its advantages in TRL's completions table, in place of GRPO's
(`self._logs["advantages"]`), and warns where a TRL release keeps that table otherwise. TRL offers no public way to
set that column: a reward function's `log_extra` adds a column beside it, which would leave the table showing
advantages that were not trained on.
"""

import warnings

import torch

from .core_algos import loss_token_mask, reinforce_plus_plus_advantages
from .trl_contract import GRPO_REWARDS, broken_fact


class ReinforcePlusPlusMixin:
    """`GRPOTrainer` mixin: REINFORCE++ advantages in place of GRPO's when `args.advantage_estimator` says
    so."""

    # The rewards of the batch being scored: every process, a column per reward function.
    _rewards_of_scored_batch: torch.Tensor | None = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_of_scored_batch = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._rewards_of_scored_batch = None
        output = super()._generate_and_score_completions(inputs)
        # A config composed of trl_lopti's fields alone (`LoptiArguments`) has no estimator field: GRPO's.
        if getattr(self.args, "advantage_estimator", "grpo") == "reinforce_plus_plus":
            rewards = self._rewards_of_scored_batch
            local = len(output["completion_mask"])
            if rewards is None or len(rewards) != local * self.accelerator.num_processes:
                saw = "no call" if rewards is None else f"{len(rewards)} rows for {local} completions per process"
                saw = f"_calculate_rewards of the generation batch: {saw}"
                raise broken_fact(GRPO_REWARDS, saw, type(self))
            output["advantages"] = self._reinforce_plus_plus_advantages(self._rewards_of_scored_batch, output)
        return output

    def _reinforce_plus_plus_advantages(self, rewards_per_func: torch.Tensor, output: dict) -> torch.Tensor:
        """This process's REINFORCE++ advantages, whitened over the loss tokens of the whole generation
        batch."""
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        # Unscorable completions, as TRL marks them.
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        mask = loss_token_mask(output)
        # In process order, as the rewards.
        lengths = self.accelerator.gather(mask.sum(dim=1))
        advantages = reinforce_plus_plus_advantages(rewards, lengths)
        local = len(output["completion_mask"])
        start = self.accelerator.process_index * local
        # The completions table shows the advantages trained on: the batch's, last in TRL's log.
        logged = self._logs["advantages"]
        trl_logged = list(logged)[len(logged) - len(advantages) :][start : start + local]
        if len(logged) >= len(advantages) and trl_logged == output["advantages"].tolist():
            for _ in range(len(advantages)):
                logged.pop()
            logged.extend(advantages.tolist())
        else:
            warnings.warn(
                "REINFORCE++: TRL's completions table does not end with this batch's GRPO advantages, so it keeps "
                "showing them rather than the REINFORCE++ advantages trained on; training is unaffected",
                UserWarning,
                stacklevel=2,
            )
        return advantages[start : start + local].to(output["completion_mask"].device)
