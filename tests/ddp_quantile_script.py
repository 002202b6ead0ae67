"""One Lopti cycle with the quantile split on a fixed generation batch, float64, as tests/test_lopti_split.py runs it
in-process (testing_utils.run_one_cycle); run by that test under `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2`
(gloo DDP on CPU).

Arguments (torchrun): model path, output folder, result path, quantile level, rows per process.
Each process trains on its own slice of the same generation batch; the result holds the final parameters and the
logged eta (`lopti/threshold`).
"""

import os
import sys

import torch
from testing_utils import (
    fixed_generation,
    patch_float64_norms,
    quantile_config,
    quantile_generation_batch,
    run_one_cycle,
)
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from trl_lopti.__main__ import exit_launched_process


def main(model_path: str, output_dir: str, result_path: str, quantile: str, rows_per_process: str) -> None:
    patch_float64_norms()  # as the in-process run of the test: float64 throughout
    vocab_size = AutoModelForCausalLM.from_pretrained(model_path).config.vocab_size
    rows = int(rows_per_process)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    batch = quantile_generation_batch(vocab_size, rows * world_size)
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
