"""LoptiRLOOTrainer trains a LoRA adapter (TRL's `peft_config`): AR and both Lopti passes reach the adapter, the base
model stays as it was, and RLOO's KL penalty takes its reference from the base model (the adapter disabled)."""

import math

import torch
from datasets import Dataset

from trl_lopti import LoptiRLOOConfig, LoptiRLOOTrainer
from trl_lopti.tasks import token_parity_reward


def test_lopti_rloo_trains_a_lora_adapter_in_both_passes_and_leaves_the_base_model(tiny_model_path, tmp_path):
    from peft import LoraConfig, PeftModel

    config = LoptiRLOOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,  # = steps_per_generation: one optimizer step per pass
        num_generations=4,
        max_completion_length=8,
        learning_rate=5e-2,
        max_steps=4,  # two generation batches, each trained by a low pass and a high pass
        advantage_reweighting_alpha=0.3,
        lopti_quantile=0.5,  # half of each batch's tokens low, whatever a random model's probabilities are
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=3,
    )  # beta: RLOO's default 0.05, a KL penalty in the reward
    trainer = LoptiRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=token_parity_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [f"Count to {i}." for i in range(8)]}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    assert isinstance(trainer.model, PeftModel) and trainer.ref_model is None  # the reference: the adapter disabled
    initial = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
    trainable = {name for name, parameter in trainer.model.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    trainer.train()

    assert trainer.state.global_step == 4
    parameters = dict(trainer.model.named_parameters())
    changed = {name for name, parameter in parameters.items() if not torch.equal(parameter.detach(), initial[name])}
    assert changed == trainable  # every adapter tensor moved (lora_A too: lora_B left 0 at the first step)
    assert all(torch.isfinite(parameter).all() for parameter in parameters.values())
    base = [name for name in parameters if "lora_" not in name]
    assert len(base) > len(trainable) and not changed & set(base)  # the base model: bit for bit as loaded

    logs = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    assert not [
        (key, value)
        for entry in logs
        for key, value in entry.items()
        if isinstance(value, float) and math.isnan(value)
    ]
    low = [entry for entry in logs if "lopti/loss_low_pass" in entry]
    high = [entry for entry in logs if "lopti/loss_high_pass" in entry]
    assert [entry["step"] for entry in low] == [1, 3] and [entry["step"] for entry in high] == [2, 4]
    assert all(entry["grad_norm"] > 0 for entry in low + high)  # both passes carried gradient to the adapter
    shares = [entry["lopti/low_token_share"] for entry in logs if "lopti/low_token_share" in entry]
    assert len(shares) == 2 and all(0.0 < share < 1.0 for share in shares)
    assert all(1 - 0.3 <= entry["lopti/ar_weight_mean"] < 1.0 for entry in low)  # AR on: its weights over the batch
    kl = [entry["kl"] for entry in logs if "kl" in entry]  # RLOO logs it at each generation batch
    assert kl[0] == 0.0 and kl[1] != 0.0  # a new adapter is the base model; after two updates it is not
