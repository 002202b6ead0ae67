"""The Lopti schedule: one cycle of LoptiGRPOTrainer equals a hand-run two-step update, and costs what it says."""

import copy
import unittest.mock

import pytest
import torch
from datasets import Dataset
from reference_grpo import completion_logps_and_entropies, reference_grpo_loss
from testing_utils import (
    COMPLETION_LENGTH,
    FLOAT64,
    TEMPERATURE,
    PolicyPassCounter,
    assert_parameters_close,
    fixed_generation_batch,
    micro_batches_as_generated,
    use_exact_log_prob_head,
)
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer


LEARNING_RATE = 0.5
# float64 (testing_utils.FLOAT64, use_exact_log_prob_head): the trainer and the hand-run agree to ~1e-12
PARAMETER_ATOL = 1e-8


def constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def run_one_cycle(
    model_path,
    output_dir,
    gradient_accumulation_steps,
    steps_per_generation,
    num_iterations,
    beta,
    lopti_order="low_first",
    importance_sampling_level="token",
    loss_type="dapo",
    exact_head=True,
    alpha=0.3,
    epsilon=0.2,
):
    per_device_train_batch_size = 2
    num_rows = per_device_train_batch_size * steps_per_generation
    batch, eta = fixed_generation_batch(model_path, num_rows, seed=0, beta=beta)
    config = LoptiGRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        num_iterations=num_iterations,
        num_generations=2,
        max_completion_length=COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        beta=beta,
        advantage_reweighting_alpha=alpha,
        epsilon=epsilon,
        lopti_threshold=float(torch.tensor(eta).exp()),
        lopti_order=lopti_order,
        importance_sampling_level=importance_sampling_level,
        loss_type=loss_type,
        optim="sgd",
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # no clipping: plain SGD
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        shuffle_dataset=False,
        **FLOAT64,
    )
    pass_optimizer_steps = steps_per_generation * num_iterations // gradient_accumulation_steps
    config.max_steps = 2 * pass_optimizer_steps  # exactly one Lopti cycle
    dataset = Dataset.from_dict({"prompt": ["p"] * 16})
    trainer = LoptiGRPOTrainer(model=model_path, reward_funcs=constant_reward, args=config, train_dataset=dataset)
    if exact_head:
        use_exact_log_prob_head(trainer)
    # not a deepcopy of trainer.model: TRL patches its forward with a closure over the original instance
    initial_model = AutoModelForCausalLM.from_pretrained(model_path)
    generation_calls = []

    def generate_fixed_batch(self, generation_batch):
        generation_calls.append(len(generation_batch))
        output = {key: value.clone() for key, value in batch.items()}
        # TRL's rule, by its own count of the times a batch is trained (Lopti's passes included)
        if self.args.gradient_accumulation_steps % (self.args.steps_per_generation * self.num_iterations) != 0:
            with torch.no_grad():
                output["old_per_token_logps"], _ = completion_logps_and_entropies(self.model, output, TEMPERATURE)
        return output

    # TRL's generation replaced beneath the trainer's own, which splits the batch
    with unittest.mock.patch.object(GRPOTrainer, "_generate_and_score_completions", generate_fixed_batch):
        trainer.train()
    return trainer, initial_model, generation_calls, eta, batch


def hand_run_cycle(initial_model, slices, config, eta_log, beta, pass_order):
    """
    Two sequential SGD updates (low tokens, then high tokens from the new parameters), ratio against pi_old.

    In each pass every value of the loss is plain GRPO's and gradient flows only through the active tokens'
    log-probabilities (the general form; for token-level losses the same gradient as zeroing the inactive tokens'
    advantages and KL). AR: token-level advantages `w * A` with a token-level ratio; with a sequence-level ratio, the
    gradient through each token's log-probability scaled by `w` (every value unchanged).
    """
    model = copy.deepcopy(initial_model)
    model.train()
    with torch.no_grad():
        old_logps = [completion_logps_and_entropies(model, micro_batch, TEMPERATURE)[0] for micro_batch in slices]
    num_items = sum(int(micro_batch["completion_mask"].sum()) for micro_batch in slices)
    micro_steps_per_pass = config.steps_per_generation * config.num_iterations
    for token_group in pass_order:
        for micro_step in range(micro_steps_per_pass):
            index = micro_step % config.steps_per_generation
            micro_batch, pi_old_logps = slices[index], old_logps[index]
            mask = micro_batch["completion_mask"].float()
            low = (pi_old_logps < eta_log).float() * mask
            active = low if token_group == "low" else mask - low
            alpha = config.advantage_reweighting_alpha
            weights = alpha * pi_old_logps.exp() + 1 - alpha
            advantages = micro_batch["advantages"][:, None].expand_as(weights)
            logps, entropies = completion_logps_and_entropies(model, micro_batch, TEMPERATURE)
            if config.importance_sampling_level == "sequence":
                logps = weights * logps + (1 - weights) * logps.detach()
            else:
                advantages = advantages * weights
            loss = reference_grpo_loss(
                logps,
                entropies,
                pi_old_logps,
                advantages,
                mask,
                loss_type=config.loss_type,
                epsilon_low=config.epsilon,
                epsilon_high=config.epsilon_high or config.epsilon,
                beta=beta,
                ref_logps=micro_batch.get("ref_per_token_logps"),
                num_items_in_batch=num_items,
                gradient_accumulation_steps=config.gradient_accumulation_steps,
                steps_per_generation=config.steps_per_generation,
                importance_sampling_level=config.importance_sampling_level,
                grad_mask=active,
            )
            loss.backward()
            if (micro_step + 1) % config.gradient_accumulation_steps == 0:
                with torch.no_grad():
                    for parameter in model.parameters():
                        if parameter.grad is not None:
                            parameter.sub_(LEARNING_RATE * parameter.grad)
                model.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize(
    "gradient_accumulation_steps, steps_per_generation, num_iterations, beta, lopti_order, is_level, loss_type, alpha, "
    "epsilon",
    [
        (2, 2, 1, 0.0, "low_first", "token", "dapo", 0.3, 0.2),  # on-policy: pi_old from the first pass's forward
        (1, 2, 1, 0.1, "low_first", "token", "dapo", 0.3, 0.2),  # steps_per_generation > accumulation: TRL's pi_old
        (1, 1, 2, 0.1, "low_first", "token", "dapo", 0.3, 0.2),  # num_iterations = 2, the KL over a second update
        (2, 2, 1, 0.1, "high_first", "token", "dapo", 0.3, 0.2),  # the paper's ablation order
        (2, 2, 1, 0.1, "low_first", "sequence", "dapo", 0.0, 0.2),  # GSPO with KL (without AR: it refuses KL there)
        (1, 1, 2, 0.1, "low_first", "sequence", "grpo", 0.0, 0.2),  # sequence ratio over two iterations, with KL
        # AR's general form under a shared ratio; a wide clip, so that the low pass leaves the high pass a gradient
        (2, 2, 1, 0.0, "low_first", "sequence", "dapo", 0.3, 1.0),  # GSPO-style sequence ratio, on-policy
        (1, 2, 1, 0.0, "low_first", "sequence", "luspo", 0.3, 1.0),  # LUSPO, off-policy pi_old
    ],
)
def test_one_lopti_cycle_equals_hand_run_two_step_update(
    tiny_float64_model_path,
    tmp_path,
    float64_norms,
    gradient_accumulation_steps,
    steps_per_generation,
    num_iterations,
    beta,
    lopti_order,
    is_level,
    loss_type,
    alpha,
    epsilon,
):
    trainer, initial_model, generation_calls, eta_log, batch = run_one_cycle(
        tiny_float64_model_path,
        tmp_path,
        gradient_accumulation_steps,
        steps_per_generation,
        num_iterations,
        beta,
        lopti_order,
        is_level,
        loss_type,
        alpha=alpha,
        epsilon=epsilon,
    )
    assert len(generation_calls) == 1, "one generation per Lopti cycle"
    pass_order = ("low", "high") if lopti_order == "low_first" else ("high", "low")
    slices = micro_batches_as_generated(trainer, batch)
    expected_model = hand_run_cycle(initial_model, slices, trainer.args, eta_log, beta, pass_order)
    assert trainer.model.dtype == expected_model.dtype == torch.float64
    largest_difference, moved = assert_parameters_close(
        dict(trainer.model.named_parameters()),
        dict(expected_model.named_parameters()),
        dict(initial_model.named_parameters()),
        atol=PARAMETER_ATOL,
    )
    # the measured figure, for the record (pytest -s)
    print(f"trainer vs hand-run: largest difference {largest_difference:.3g}, moved {moved:.3g} in all")  # noqa: T201
    assert moved > 1e-3, "the update must move the parameters"
    # and the second pass matters: stopping after the first pass gives different parameters
    first_pass_only = hand_run_cycle(initial_model, slices, trainer.args, eta_log, beta, pass_order[:1])
    assert any(
        not torch.allclose(a, b, atol=1e-6)
        for a, b in zip(first_pass_only.parameters(), expected_model.parameters(), strict=True)
    )
    losses = [entry for entry in trainer.state.log_history if "loss" in entry]
    first_key, second_key = (f"lopti/loss_{group}_pass" for group in pass_order)
    passes_per_step = [first_key if first_key in entry else second_key for entry in losses]
    pass_steps = len(losses) // 2
    assert passes_per_step == [first_key] * pass_steps + [second_key] * pass_steps


def test_one_lopti_cycle_in_float32_with_trls_own_log_prob_head(tiny_model_path, tmp_path):
    """The real dtype path (float32, TRL's fused head, Qwen2's float32 norms) against the same hand-run."""
    trainer, initial_model, _, eta_log, batch = run_one_cycle(
        tiny_model_path, tmp_path, 2, 2, 1, 0.1, exact_head=False
    )
    slices = micro_batches_as_generated(trainer, batch)
    expected_model = hand_run_cycle(initial_model, slices, trainer.args, eta_log, 0.1, ("low", "high"))
    assert trainer.model.dtype == torch.float32
    # float32 rounding of two forward implementations, amplified by lr 0.5: ~1e-5 of how far a tensor moved
    _, moved = assert_parameters_close(
        dict(trainer.model.named_parameters()),
        dict(expected_model.named_parameters()),
        dict(initial_model.named_parameters()),
        atol=1e-7,
        relative_to_move=1e-4,
    )
    assert moved > 1e-3


def count_passes(trainer_class, model_path, output_dir, num_generation_batches, **lopti_fields):
    config_class = LoptiGRPOConfig if issubclass(trainer_class, LoptiGRPOTrainer) else None
    common = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=6,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        bf16=False,
    )
    if config_class is None:
        from trl import GRPOConfig

        config = GRPOConfig(**common)
    else:
        config = LoptiGRPOConfig(**common, **lopti_fields)
    steps_per_batch = 2 if (config_class is not None and config.lopti_threshold is not None) else 1
    config.max_steps = steps_per_batch * num_generation_batches
    dataset = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(16)]})
    trainer = trainer_class(
        model=model_path,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=config,
        train_dataset=dataset,
    )
    counter = PolicyPassCounter(trainer.model)
    trainer.train()
    return counter


def test_forward_and_backward_counts_per_generation_batch(tiny_model_path, tmp_path, mid_gap_trainer):
    """On-policy (TRL skips old log-probs): AR adds no pass; Lopti doubles the forward+backward, and TRL computes pi_old
    at generation (its rule: the generation batch spans several optimizer steps)."""
    batches = 2
    grpo = count_passes(GRPOTrainer, tiny_model_path, tmp_path / "grpo", batches)
    ar = count_passes(LoptiGRPOTrainer, tiny_model_path, tmp_path / "ar", batches, lopti_threshold=None)
    # both passes have tokens: each generation batch's threshold lies half-way in a wide gap of its pi_old
    lopti = count_passes(
        mid_gap_trainer,
        tiny_model_path,
        tmp_path / "lopti",
        batches,
        advantage_reweighting_alpha=0.3,
        lopti_threshold=0.5,
    )
    assert len(mid_gap_trainer.etas) == batches
    assert grpo.forwards_with_grad == 2 * batches and grpo.forwards_without_grad == 0
    assert (ar.forwards_with_grad, ar.forwards_without_grad, ar.backwards) == (
        grpo.forwards_with_grad,
        grpo.forwards_without_grad,
        grpo.backwards,
    )
    assert lopti.forwards_with_grad == 2 * grpo.forwards_with_grad
    # TRL's own pi_old forward at generation (a generation batch spans both passes' optimizer steps), in micro-batches
    # of per_device_train_batch_size (2 per generation batch here), and the fixture's, one per generation batch
    pi_old_forwards = 2 * batches
    assert lopti.forwards_without_grad == pi_old_forwards + len(mid_gap_trainer.etas)
    assert lopti.backwards == 2 * grpo.backwards
