"""Run by tests/test_distributed.py: one Lopti cycle on a fixed generation batch, under torchrun with 1 or 2 processes.

With N processes each process trains on its 1/N of the same global generation batch (per-device batch 4 / N), so the
two runs see the same completions; the final parameters are written by rank 0. Arguments: model path, output folder,
result path, and optionally `anchor`: the trainer's loss first runs a frozen anchor model's forward, without gradient
(`testing_utils.anchor_metric_trainer`), which must change nothing.
"""

import os
import sys

import torch
from datasets import Dataset
from testing_utils import (
    COMPLETION_LENGTH,
    FLOAT64,
    TEMPERATURE,
    anchor_metric_trainer,
    completion_logps,
    fixed_generation_batch,
    patch_float64_norms,
    perturbed_model,
    use_exact_log_prob_head,
)
from trl import GRPOTrainer

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer
from trl_lopti.__main__ import exit_launched_process


GLOBAL_ROWS_PER_MICRO_STEP, STEPS_PER_GENERATION = 4, 2


def main(model_path: str, output_dir: str, result_path: str, loss: str = "trl") -> None:
    patch_float64_norms()  # float64 model (testing_utils.FLOAT64): the two runs agree to ~1e-15
    rows = GLOBAL_ROWS_PER_MICRO_STEP * STEPS_PER_GENERATION
    batch, eta_log = fixed_generation_batch(model_path, rows, seed=0, beta=0.1)  # pi_ref = the initial policy
    eta = float(torch.tensor(eta_log).exp())
    world_size = int(os.environ["WORLD_SIZE"])
    config = LoptiGRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=GLOBAL_ROWS_PER_MICRO_STEP // world_size,
        gradient_accumulation_steps=STEPS_PER_GENERATION,
        steps_per_generation=STEPS_PER_GENERATION,
        num_generations=2,
        max_completion_length=COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        beta=0.0,  # AR's general form (a sequence-level ratio) refuses a KL term
        advantage_reweighting_alpha=0.3,
        lopti_threshold=eta,
        importance_sampling_level="sequence",
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        max_steps=2,
        shuffle_dataset=False,
        **FLOAT64,
    )
    trainer_class = LoptiGRPOTrainer
    anchors = []
    if loss == "anchor":
        anchors.append(perturbed_model(model_path, dtype=torch.float64))
        trainer_class = anchor_metric_trainer(anchors[0])
    trainer = trainer_class(
        model=model_path,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * 16}),
    )
    assert trainer.accelerator.num_processes == world_size and trainer.model.dtype == torch.float64
    use_exact_log_prob_head(trainer, *anchors)
    rank = trainer.accelerator.process_index
    local_rows = rows // world_size
    generations = []

    def local_slice(self, generation_batch):
        generations.append(1)
        rows = slice(rank * local_rows, (rank + 1) * local_rows)
        # every per-row tensor is sliced; num_items_in_batch stays global, as TRL gathers it over processes
        local = {key: value[rows].clone() if value.dim() else value.clone() for key, value in batch.items()}
        # pi_old by TRL's rule: the batch spans both passes' optimizer steps
        if self.args.gradient_accumulation_steps % (self.args.steps_per_generation * self.num_iterations):
            with torch.no_grad():
                local["old_per_token_logps"] = completion_logps(self.model, local)
        return local

    # TRL's generation replaced beneath the trainer's own, which splits the batch
    GRPOTrainer._generate_and_score_completions = local_slice
    trainer.train()
    assert len(generations) == 1 and trainer.state.global_step == 2
    if trainer.accelerator.is_main_process:
        state = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
        torch.save({"world_size": world_size, "parameters": state}, result_path)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    exit_launched_process(0)  # as `python -m trl_lopti` ends under a launcher
