"""One Lopti cycle with the quantile split on a fixed generation batch, float64; run in-process by
tests/test_lopti_split.py, and by it under `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2` (gloo DDP on CPU).

Arguments (torchrun): model path, output folder, result path, quantile level, rows per process.
Each process trains on its own slice of the same generation batch; the result holds the final parameters and the
logged eta (`lopti/threshold`).
"""

import os
import sys

import torch
from conftest import patch_float64_norms, use_exact_log_prob_head
from datasets import Dataset
from reference_grpo import completion_logps_and_entropies
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer
from trl_lopti.__main__ import exit_launched_process


TEMPERATURE = 0.7
PROMPT_LENGTH = 4
COMPLETION_LENGTH = 6
LEARNING_RATE = 0.5
ALPHA = 0.3
# plain SGD (no momentum, decay or clipping, constant rate): the update a hand run makes with torch.optim.SGD
PLAIN_SGD = dict(
    optim="sgd", learning_rate=LEARNING_RATE, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0
)


def completion_logps(model, batch: dict) -> torch.Tensor:
    """Log-probabilities of the sampled completion tokens at `TEMPERATURE`, in the model's precision (float64 here)."""
    return completion_logps_and_entropies(model, batch, TEMPERATURE)[0]


def fixed_generation_batch(vocab_size: int, num_rows: int, seed: int = 0) -> dict:
    """A whole generation batch (every process) as `_generate_and_score_completions` returns it, less pi_old."""
    generator = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(num_rows, COMPLETION_LENGTH, dtype=torch.long)
    lengths = torch.randint(2, COMPLETION_LENGTH + 1, (num_rows,), generator=generator)
    completion_mask[torch.arange(COMPLETION_LENGTH)[None, :] >= lengths[:, None]] = 0  # padding
    return {
        "prompt_ids": torch.randint(3, vocab_size, (num_rows, PROMPT_LENGTH), generator=generator),
        "prompt_mask": torch.ones(num_rows, PROMPT_LENGTH, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab_size, (num_rows, COMPLETION_LENGTH), generator=generator),
        "completion_mask": completion_mask,
        "advantages": torch.randn(num_rows, generator=generator, dtype=torch.float64),
        "row_id": torch.arange(
            num_rows
        ),  # follows the rows through TRL's shuffle (conftest.micro_batches_as_generated)
    }


def fixed_generation(batch: dict):
    """A stand-in for `GRPOTrainer._generate_and_score_completions`: this process's slice of `batch`.

    Like TRL it computes pi_old at generation only when gradient_accumulation_steps is not a multiple of
    steps_per_generation * num_iterations (the rule LoptiGRPOTrainer relies on to get pi_old for the quantile).
    """

    def generate(self, inputs):
        rows = len(inputs)
        start = self.accelerator.process_index * rows
        output = {key: value[start : start + rows].clone() for key, value in batch.items()}
        output["num_items_in_batch"] = batch["completion_mask"].sum()  # every process's tokens, as TRL gathers them
        if self.args.gradient_accumulation_steps % (self.args.steps_per_generation * self.num_iterations) != 0:
            with torch.no_grad():
                output["old_per_token_logps"] = completion_logps(self.model, output)
        return output

    return generate


def quantile_config(
    output_dir: str,
    rows_per_process: int,
    gradient_accumulation_steps: int,
    steps_per_generation: int,
    quantile: float,
    **overrides,
) -> LoptiGRPOConfig:
    values = dict(
        output_dir=output_dir,
        per_device_train_batch_size=rows_per_process // steps_per_generation,
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        num_generations=2,
        max_completion_length=COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        beta=0.0,
        advantage_reweighting_alpha=ALPHA,
        lopti_threshold=None,
        lopti_quantile=quantile,
        **PLAIN_SGD,
        bf16=False,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        shuffle_dataset=False,
        max_steps=2 * steps_per_generation // gradient_accumulation_steps,  # exactly one Lopti cycle
    )
    values.update(overrides)
    return LoptiGRPOConfig(**values)


def run_one_cycle(model_path: str, config: LoptiGRPOConfig, batch: dict) -> LoptiGRPOTrainer:
    """Trains one Lopti cycle of a float64 copy of the model on `batch` (the caller installs `fixed_generation`)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    trainer = LoptiGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * 64}),
    )
    use_exact_log_prob_head(trainer)  # TRL's fused head is float32 whatever the model's dtype; the hand run is not
    trainer.train()
    return trainer


def main(model_path: str, output_dir: str, result_path: str, quantile: str, rows_per_process: str) -> None:
    patch_float64_norms()  # as the in-process run of the test: float64 throughout
    vocab_size = AutoModelForCausalLM.from_pretrained(model_path).config.vocab_size
    rows = int(rows_per_process)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    batch = fixed_generation_batch(vocab_size, rows * world_size)
    GRPOTrainer._generate_and_score_completions = fixed_generation(batch)
    config = quantile_config(output_dir, rows, 2, 2, float(quantile))
    trainer = run_one_cycle(model_path, config, batch)
    if trainer.accelerator.is_main_process:
        torch.save(
            {
                "world_size": trainer.accelerator.num_processes,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "thresholds": [e["lopti/threshold"] for e in trainer.state.log_history if "lopti/threshold" in e],
                "parameters": {name: p.detach().clone() for name, p in trainer.model.named_parameters()},
            },
            result_path,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_launched_process(0)  # as `python -m trl_lopti` ends under a launcher
