"""Run by tests/test_trl_contract.py under `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2`: TRL's reward gathering.

Arguments: model path, output folder, result path. Trains TRL's own GRPOTrainer for two generation batches with a
reward function that tags each value with its process rank, and records, on every rank, the rewards the function
returned and what `GRPOTrainer._calculate_rewards` returned (and how often it ran).
"""

import json
import os
import sys

import torch.distributed as dist
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_lopti.__main__ import exit_launched_process


def main(model_path: str, output_dir: str, result_path: str) -> None:
    rank = int(os.environ["RANK"])
    local_rewards, gathered_rewards = [], []

    def rank_tagged_reward(completions, **kwargs):
        rewards = [100.0 * rank + i for i in range(len(completions))]
        local_rewards.append(rewards)
        return rewards

    calculate_rewards = GRPOTrainer._calculate_rewards

    def recorded(self, *args, **kwargs):
        rewards_per_func = calculate_rewards(self, *args, **kwargs)
        gathered_rewards.append(rewards_per_func[:, 0].tolist())
        return rewards_per_func

    GRPOTrainer._calculate_rewards = recorded
    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": [f"Say something about {i}." for i in range(8)]})
    trainer = GRPOTrainer(model=model_path, reward_funcs=rank_tagged_reward, args=config, train_dataset=dataset)
    trainer.train()
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, {"local": local_rewards, "gathered": gathered_rewards})
    if rank == 0:
        result = {
            "world_size": dist.get_world_size(),
            "local_rewards": [entry["local"] for entry in every_rank],
            "gathered_rewards": [entry["gathered"] for entry in every_rank],
        }
        with open(result_path, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    exit_launched_process(0)  # as `python -m trl_lopti` ends under a launcher
