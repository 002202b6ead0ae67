"""How much gradient a Lopti pass sends to its inactive tokens: advantage zeroing vs the general form.

For each loss setup, on one batch of a tiny random Qwen2 model (CPU, seconds), prints the summed |dL/d logp| over the
active and over the inactive tokens of the low pass, (a) when the inactive tokens only get a zero advantage (the
paper's token-level recipe, applied as is) and (b) with LoptiGRPOTrainer (gradient only through active tokens).

    python benchmarks/isolation_leak.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from trl import GRPOTrainer


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import threshold_between_values  # noqa: E402
from reference_grpo import completion_logps_and_entropies  # noqa: E402

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer  # noqa: E402
from trl_lopti.models import build_tiny_model  # noqa: E402


SETUPS = {
    "token-level dapo": dict(loss_type="dapo", importance_sampling_level="token"),
    "GSPO (sequence-level dapo)": dict(loss_type="dapo", importance_sampling_level="sequence"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
}


def logp_gradients(trainer, inputs, token_group, monkeypatched_capture):
    trainer._step = 0
    trainer.lopti_token_group = lambda: token_group
    trainer.model.zero_grad(set_to_none=True)
    trainer.compute_loss(trainer.model, dict(inputs)).backward()
    return monkeypatched_capture["logps"].grad.clone()


def main() -> None:
    captured = {}
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def capture(self, *args, **kwargs):
        logps, entropies, aux = original(self, *args, **kwargs)
        if logps.requires_grad:
            logps.retain_grad()
            captured["logps"] = logps
        return logps, entropies, aux

    GRPOTrainer._get_per_token_logps_and_entropies = capture
    with tempfile.TemporaryDirectory() as folder:
        model_path = build_tiny_model(Path(folder) / "model")
        print(f"| setup | zeroed advantages: active | inactive | general form: active | inactive |")
        print("|---|---|---|---|---|")
        for name, setup in SETUPS.items():
            config = LoptiGRPOConfig(output_dir=folder, per_device_train_batch_size=4, num_generations=4,
                                     max_completion_length=7, temperature=0.7, report_to="none", use_cpu=True,
                                     bf16=False, advantage_reweighting_alpha=0.0, **setup)
            trainer = LoptiGRPOTrainer(model=model_path, reward_funcs=lambda completions, **kw: [0.0] * 4,
                                       args=config, train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}))
            trainer.current_gradient_accumulation_steps = 1
            trainer.model.train()
            generator = torch.Generator().manual_seed(7)
            vocab = trainer.model.config.vocab_size
            inputs = {
                "prompt_ids": torch.randint(3, vocab, (4, 5), generator=generator),
                "prompt_mask": torch.ones(4, 5, dtype=torch.long),
                "completion_ids": torch.randint(3, vocab, (4, 7), generator=generator),
                "completion_mask": torch.ones(4, 7, dtype=torch.long),
                "advantages": torch.randn(4, generator=generator),
                "num_items_in_batch": torch.tensor(28),
            }
            with torch.no_grad():
                logps, _ = completion_logps_and_entropies(trainer.model, inputs, 0.7)
            inputs["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=generator)
            eta = threshold_between_values(inputs["old_per_token_logps"].exp())
            trainer.lopti_threshold = eta
            low = inputs["old_per_token_logps"].exp() < eta
            zeroed = dict(inputs, advantages=torch.where(low, inputs["advantages"][:, None], 0.0))
            leaky = logp_gradients(trainer, zeroed, None, captured)  # every token differentiable, A = 0 off-group
            isolated = logp_gradients(trainer, inputs, "low", captured)
            figures = [float(g[mask].abs().sum()) for g in (leaky, isolated) for mask in (low, ~low)]
            print(f"| {name} | " + " | ".join(f"{value:.4g}" for value in figures) + " |")
    GRPOTrainer._get_per_token_logps_and_entropies = original


if __name__ == "__main__":
    main()
