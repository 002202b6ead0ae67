"""Run by tests/test_distributed.py under `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2` (gloo DDP on CPU).

Arguments: model path, output folder, result path, and the advantage estimator ("grpo" or "reinforce_plus_plus").
With REINFORCE++ it also records, per generation batch and rank, the rewards, completion lengths and advantages.
"""

import json
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from testing_utils import mid_gap_eta_trainer
from transformers import TrainerCallback

from trl_lopti import LoptiGRPOConfig
from trl_lopti.__main__ import exit_launched_process


def length_reward(completions, **kwargs):
    return [float(len(completion) % 5) for completion in completions]


def parameter_fingerprint(model) -> torch.Tensor:
    return torch.stack(
        [p.detach().double().sum() for p in model.parameters()]
        + [p.detach().double().pow(2).sum() for p in model.parameters()]
    )


def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


class RecordAfterEachStep(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.records = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        fingerprints = gathered(parameter_fingerprint(model))
        micro_batch = self.trainer._buffered_inputs[0]
        completion_hash = (
            (
                micro_batch["completion_ids"].double()
                * torch.arange(micro_batch["completion_ids"].numel()).view_as(micro_batch["completion_ids"])
            )
            .sum()
            .reshape(1)
        )
        hashes = gathered(completion_hash)
        self.records.append(
            {
                "step": state.global_step,
                "ranks_equal": bool(torch.equal(fingerprints[0], fingerprints[1])),
                "ranks_saw_different_completions": bool(hashes[0].item() != hashes[1].item()),
            }
        )


class RecordAdvantages:
    """Wraps the trainer's generation to keep each generation batch's local rewards, lengths and advantages."""

    def __init__(self):
        self.rewards, self.batches = [], []

    def attach(self, trainer):
        generate = trainer._generate_and_score_completions

        def recorded(inputs):
            self.rewards.clear()
            output = generate(inputs)
            self.batches.append(
                {
                    "rewards": list(self.rewards),
                    "lengths": output["completion_mask"].sum(dim=1).tolist(),
                    "advantages": output["advantages"].tolist(),
                }
            )
            return output

        trainer._generate_and_score_completions = recorded

    def reward(self, completions, **kwargs):
        rewards = length_reward(completions)
        self.rewards.extend(rewards)
        return rewards


def main(model_path: str, output_dir: str, result_path: str, advantage_estimator: str = "grpo") -> None:
    trainer_class = mid_gap_eta_trainer()  # one eta for both processes, from the tokens of both
    config = LoptiGRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        advantage_reweighting_alpha=0.3,
        lopti_threshold=0.5,  # in place of it, each generation batch's eta lies half-way in a wide gap of its pi_old
        advantage_estimator=advantage_estimator,
        seed=3,
    )
    dataset = Dataset.from_dict({"prompt": [f"Say something about {i}." for i in range(16)]})
    recorder = RecordAfterEachStep()
    advantages = RecordAdvantages() if advantage_estimator == "reinforce_plus_plus" else None
    reward = advantages.reward if advantages is not None else length_reward
    trainer = trainer_class(
        model=model_path, reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[recorder]
    )
    recorder.trainer = trainer
    if advantages is not None:
        advantages.attach(trainer)
    initial = parameter_fingerprint(trainer.model)
    trainer.train()
    final = gathered(parameter_fingerprint(trainer.model))
    per_rank_batches = None
    if advantages is not None:
        per_rank_batches = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank_batches, advantages.batches)
    if trainer.accelerator.is_main_process:
        result = {
            "world_size": dist.get_world_size(),
            "distributed_type": str(trainer.accelerator.distributed_type),
            "steps": recorder.records,
            "final_ranks_equal": bool(torch.equal(final[0], final[1])),
            "model_changed": bool(not torch.equal(initial, final[0])),
            "low_pass_losses": [
                e["lopti/loss_low_pass"] for e in trainer.state.log_history if "lopti/loss_low_pass" in e
            ],
            "high_pass_losses": [
                e["lopti/loss_high_pass"] for e in trainer.state.log_history if "lopti/loss_high_pass" in e
            ],
            "per_rank_batches": per_rank_batches,
            "thresholds": trainer_class.etas,
            "low_token_shares": [
                e["lopti/low_token_share"] for e in trainer.state.log_history if "lopti/low_token_share" in e
            ],
        }
        with open(result_path, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_launched_process(0)  # as `python -m trl_lopti` ends under a launcher
