"""REINFORCE++, the paper's second base algorithm, as one advantage estimator beside TRL's group-relative one.

`ReinforcePlusPlusMixin`, a base class of `LoptiGRPOTrainer`, acts only with `advantage_estimator=
"reinforce_plus_plus"`: it replaces each generation batch's advantages by `core_algos.reinforce_plus_plus_advantages`
of its rewards, before AR and Lopti read them. Deleting it (and the config value) changes nothing else.

It relies on facts G3 (`_calculate_rewards`) and G4 (`self._logs["advantages"]`), stated and checked in
`trl_lopti/trl_contract.py`.
"""

import torch

from .core_algos import loss_token_mask, reinforce_plus_plus_advantages
from .trl_contract import broken_fact


class ReinforcePlusPlusMixin:
    """`GRPOTrainer` mixin: REINFORCE++ advantages in place of GRPO's when `args.advantage_estimator` says so."""

    _rewards_of_scored_batch: torch.Tensor | None = None  # the batch being scored: every process, a column per reward

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_of_scored_batch = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._rewards_of_scored_batch = None
        output = super()._generate_and_score_completions(inputs)
        if self.args.advantage_estimator == "reinforce_plus_plus":
            rewards, local = self._rewards_of_scored_batch, len(output["completion_mask"])
            if rewards is None or len(rewards) != local * self.accelerator.num_processes:
                saw = "no call" if rewards is None else f"{len(rewards)} rows for {local} completions per process"
                raise broken_fact("G3", f"_calculate_rewards of the generation batch: {saw}")
            output["advantages"] = self._reinforce_plus_plus_advantages(self._rewards_of_scored_batch, output)
        return output

    def _reinforce_plus_plus_advantages(self, rewards_per_func: torch.Tensor, output: dict) -> torch.Tensor:
        """This process's REINFORCE++ advantages, whitened over the loss tokens of the whole generation batch."""
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # unscorable, as TRL marks them
        mask = loss_token_mask(output)
        lengths = self.accelerator.gather(mask.sum(dim=1))  # process order, as the rewards
        advantages = reinforce_plus_plus_advantages(rewards, lengths)
        local = len(output["completion_mask"])
        start = self.accelerator.process_index * local
        logged = self._logs["advantages"]  # fact G4: the completions table shows the advantages trained on
        trl_logged = list(logged)[len(logged) - len(advantages) :][start : start + local]
        if len(logged) < len(advantages) or trl_logged != output["advantages"].tolist():
            raise broken_fact("G4", "the last advantages in self._logs['advantages'] are not the batch's")
        for _ in range(len(advantages)):
            logged.pop()
        logged.extend(advantages.tolist())
        return advantages[start : start + local].to(output["completion_mask"].device)
