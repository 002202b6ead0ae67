"""Run by tests/test_distributed.py: one Lopti cycle on a fixed generation batch, under torchrun with 1 or 2 processes.

With N processes each process trains on its 1/N of the same global generation batch (per-device batch 4 / N), so the
two runs see the same completions; the final parameters are written by rank 0.
"""

import os
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from conftest import threshold_between_values
from reference_grpo import completion_logps_and_entropies
from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer


TEMPERATURE = 0.7
GLOBAL_ROWS_PER_MICRO_STEP, STEPS_PER_GENERATION, COMPLETION_LENGTH, PROMPT_LENGTH = 4, 2, 6, 4


def global_generation_batch(model_path: str) -> tuple[dict, float]:
    generator = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    rows = GLOBAL_ROWS_PER_MICRO_STEP * STEPS_PER_GENERATION
    vocab_size = model.config.vocab_size
    completion_mask = torch.ones(rows, COMPLETION_LENGTH, dtype=torch.long)
    completion_mask[0, 3:] = 0
    completion_mask[5, 4:] = 0
    batch = {
        "prompt_ids": torch.randint(3, vocab_size, (rows, PROMPT_LENGTH), generator=generator),
        "prompt_mask": torch.ones(rows, PROMPT_LENGTH, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab_size, (rows, COMPLETION_LENGTH), generator=generator),
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=generator),
    }
    with torch.no_grad():
        logps, _ = completion_logps_and_entropies(model, batch, TEMPERATURE)
    batch["ref_per_token_logps"] = logps  # the reference model is the initial model
    return batch, threshold_between_values(logps[completion_mask.bool()].exp())


def main(model_path: str, output_dir: str, result_path: str) -> None:
    batch, eta = global_generation_batch(model_path)
    world_size = int(os.environ["WORLD_SIZE"])
    config = LoptiGRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_ROWS_PER_MICRO_STEP // world_size, gradient_accumulation_steps=STEPS_PER_GENERATION,
        steps_per_generation=STEPS_PER_GENERATION, num_generations=2, max_completion_length=COMPLETION_LENGTH,
        temperature=TEMPERATURE, beta=0.1, advantage_reweighting_alpha=0.3, lopti_threshold=eta,
        importance_sampling_level="sequence", optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, bf16=False, report_to="none", use_cpu=True, save_strategy="no",
        max_steps=2, shuffle_dataset=False,
    )
    trainer = LoptiGRPOTrainer(model=model_path, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=config, train_dataset=Dataset.from_dict({"prompt": ["p"] * 16}))
    assert trainer.accelerator.num_processes == world_size
    rank = trainer.accelerator.process_index
    local_rows = len(batch["advantages"]) // world_size
    generations = []

    def local_slice(generation_batch):
        generations.append(1)
        rows = slice(rank * local_rows, (rank + 1) * local_rows)
        local = {key: value[rows].clone() for key, value in batch.items()}
        local["num_items_in_batch"] = batch["completion_mask"].sum()  # TRL gathers it over processes
        return local

    trainer._generate_and_score_completions = local_slice
    trainer.train()
    assert len(generations) == 1 and trainer.state.global_step == 2
    if trainer.accelerator.is_main_process:
        state = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
        torch.save({"world_size": world_size, "parameters": state}, result_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
