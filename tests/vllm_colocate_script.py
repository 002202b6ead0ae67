"""TRL's colocate mode (vLLM inside the trainer process) on the CPU, run by tests/test_vllm.py in a process of its own
(vLLM initialises a process group there): `python vllm_colocate_script.py MODEL_FOLDER OUTPUT.json`.

It trains three Lopti generation batches with rollouts from the colocated engine, with transformers' `generate` made
to fail, and writes, per optimizer step, whether the engine's weights equal the trainer's (cast to the engine's
dtype; fused projections compared against the trainer's pieces concatenated), and TRL's logs.
"""

import json
import os
import sys

import torch
from datasets import Dataset
from testing_utils import PROMPTS, no_transformers_generate
from transformers import GenerationMixin, TrainerCallback

from trl_lopti.cpu_backends import vllm as cpu_vllm


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused projections of a Qwen2 layer and the trainer's parameters they concatenate."""


def trainer_counterpart(name: str, trainer_parameters: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trainer's tensor that the engine's parameter `name` holds."""
    for fused, pieces in FUSED.items():
        if fused in name:
            return torch.cat([trainer_parameters[name.replace(fused, piece)] for piece in pieces])
    return trainer_parameters[name]


class EngineWeights(TrainerCallback):
    """Before each optimizer step: does the colocated engine hold the trainer's current weights?"""

    def __init__(self, trainer):
        self.trainer, self.equal_at_steps, self.unequal_at_steps = trainer, [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        engine = self.trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
        trained = {name: parameter.detach() for name, parameter in self.trainer.model.named_parameters()}
        equal = all(
            torch.equal(parameter, trainer_counterpart(name, trained).to(parameter.dtype))
            for name, parameter in engine.named_parameters()
        )
        (self.equal_at_steps if equal else self.unequal_at_steps).append(state.global_step)


def main(model: str, output: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cpu_vllm.install_trainer_side()  # no prepacking: the engine's linear layers compute on the weights TRL loads

    GenerationMixin.generate = no_transformers_generate
    from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer
    from trl_lopti.tasks import token_parity_reward

    config = LoptiGRPOConfig(
        output_dir=os.path.join(os.path.dirname(output), "colocate"),
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        max_steps=6,
        max_completion_length=12,
        learning_rate=2e-4,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=512,
        vllm_enable_sleep_mode=False,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        seed=0,
    )
    prompts = Dataset.from_dict({"prompt": PROMPTS})
    trainer = LoptiGRPOTrainer(model=model, reward_funcs=token_parity_reward, args=config, train_dataset=prompts)
    check = EngineWeights(trainer)
    trainer.add_callback(check)
    trainer.train()
    engine = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    result = {
        "equal_at_steps": check.equal_at_steps,
        "unequal_at_steps": check.unequal_at_steps,
        "engine_dtype": str(next(engine.parameters()).dtype),
        "log_history": trainer.state.log_history,
    }
    with open(output, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(*sys.argv[1:3])
