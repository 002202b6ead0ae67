"""Real training runs of LoptiGRPOTrainer on a tiny random Qwen2 model (CPU)."""

import math
import os
import warnings

import pytest
import torch
from testing_utils import (
    ETA_FROM_EACH_BATCH,
    FLOAT64,
    PolicyPassCounter,
    assert_no_nan_in_logs,
    assert_parameters_close,
    conversational_dataset,
    length_reward,
    logged,
    small_config,
)
from trl import GRPOConfig, GRPOTrainer

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def train(model, config, reward=length_reward, dataset=None, trainer_class=LoptiGRPOTrainer, **trainer_kwargs):
    trainer = trainer_class(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset or conversational_dataset(),
        **trainer_kwargs,
    )
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, initial


def changed_parameters(trainer, initial) -> set[str]:
    return {name for name, p in trainer.model.named_parameters() if not torch.equal(p.detach(), initial[name])}


@pytest.mark.parametrize(
    "alpha, eta",
    [(0.3, None), (0.0, ETA_FROM_EACH_BATCH), (0.3, ETA_FROM_EACH_BATCH)],
    ids=["ar", "lopti", "ar+lopti"],
)
def test_training_changes_the_model_and_logs_lopti_metrics(tiny_model_path, tmp_path, mid_gap_trainer, alpha, eta):
    config = small_config(tmp_path, advantage_reweighting_alpha=alpha, lopti_threshold=eta)
    trainer, initial = train(tiny_model_path, config, trainer_class=mid_gap_trainer)
    assert trainer.state.global_step == 4
    assert changed_parameters(trainer, initial) == set(initial), "every parameter of a full fine-tune moves"
    assert_no_nan_in_logs(trainer)
    low_share = logged(trainer, "lopti/low_token_share")
    assert low_share and all(0.0 <= share <= 1.0 for share in low_share)
    if alpha:
        weights = logged(trainer, "lopti/ar_weight_mean")
        assert weights and all(1 - alpha <= weight <= 1.0 for weight in weights)
    if eta is not None:
        assert len(mid_gap_trainer.etas) == 2, "one eta per generation batch"
        assert 0.0 < min(low_share) and max(low_share) < 1.0, "the batch's threshold splits its tokens"
        assert len(logged(trainer, "lopti/loss_low_pass")) == 2
        assert len(logged(trainer, "lopti/loss_high_pass")) == 2
        # two optimizer steps per generation batch: 4 steps = 2 generations
        assert len(logged(trainer, "num_tokens")) == 2


def test_both_methods_disabled_is_grpo_trainer(tiny_float64_model_path, tmp_path):
    """Two float64 runs: equal to 1e-8 on any CPU (a changed step, advantage or loss moves parameters by >1e-4)."""
    grpo, _ = train(
        tiny_float64_model_path, small_config(tmp_path / "grpo", GRPOConfig, **FLOAT64), trainer_class=GRPOTrainer
    )
    plain = small_config(tmp_path / "lopti", advantage_reweighting_alpha=0.0, lopti_threshold=None, **FLOAT64)
    lopti, initial = train(tiny_float64_model_path, plain)
    assert lopti.model.dtype == grpo.model.dtype == torch.float64
    assert changed_parameters(lopti, initial)
    _, moved = assert_parameters_close(
        dict(lopti.model.named_parameters()), dict(grpo.model.named_parameters()), initial, atol=1e-8
    )
    assert moved > 1e-3
    assert logged(lopti, "loss") == pytest.approx(logged(grpo, "loss"), rel=1e-8, abs=1e-10)


def test_a_plain_grpo_config_gets_the_paper_defaults(tiny_model_path, tmp_path):
    config = small_config(tmp_path, GRPOConfig, learning_rate=3e-3, max_steps=2)
    with pytest.warns(UserWarning, match="plain GRPOConfig"):
        trainer = LoptiGRPOTrainer(
            model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
        )
    assert isinstance(trainer.args, LoptiGRPOConfig)
    assert (trainer.args.advantage_reweighting_alpha, trainer.args.lopti_threshold) == (0.3, 0.5)
    assert trainer.args.learning_rate == 3e-3 and trainer.args.steps_per_generation == 2


def test_lora_with_lopti_changes_only_adapter_weights(tiny_model_path, tmp_path, mid_gap_trainer):
    from peft import LoraConfig

    config = small_config(tmp_path, lopti_threshold=ETA_FROM_EACH_BATCH, learning_rate=5e-2)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, initial = train(tiny_model_path, config, trainer_class=mid_gap_trainer, peft_config=peft_config)
    changed = changed_parameters(trainer, initial)
    assert changed, "the adapters must train"
    assert all("lora_" in name for name in changed), sorted(changed)
    assert any("lora_A" in name for name in changed) and any("lora_B" in name for name in changed)
    assert len(logged(trainer, "lopti/loss_high_pass")) == 2


@pytest.mark.parametrize(
    "case, overrides, reward",
    [
        ("all rewards equal", dict(lopti_threshold=ETA_FROM_EACH_BATCH), constant_reward),
        ("no low tokens", dict(lopti_threshold=1e-6), length_reward),
        ("no high tokens", dict(lopti_threshold=0.999), length_reward),
        (
            "empty completions",
            dict(mask_truncated_completions=True, max_completion_length=2, loss_type="grpo"),
            length_reward,
        ),
    ],
)
def test_degenerate_batches_do_not_produce_nan(tiny_model_path, tmp_path, mid_gap_trainer, case, overrides, reward):
    config = small_config(tmp_path, beta=0.05, **overrides)
    trainer_class = mid_gap_trainer if case == "all rewards equal" else LoptiGRPOTrainer
    trainer = trainer_class(
        model=tiny_model_path, reward_funcs=reward, args=config, train_dataset=conversational_dataset()
    )
    counter = PolicyPassCounter(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 4
    assert_no_nan_in_logs(trainer)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    micro_steps_per_pass = 2  # gradient_accumulation_steps = steps_per_generation = 2
    if case == "no high tokens":
        # the empty second pass is an ordinary pass (as the authors run it) whose gradient is zero
        assert counter.forwards_with_grad == 2 * 2 * micro_steps_per_pass
        assert logged(trainer, "grad_norm")[1::2] == [0.0, 0.0]
    if case == "empty completions":
        assert trainer.state.log_history[0]["completions/clipped_ratio"] == 1.0


def test_resume_between_the_two_passes_continues_the_batch_to_the_uninterrupted_parameters(
    tiny_float64_model_path, tmp_path, mid_gap_trainer, float64_norms
):
    """A checkpoint after a low pass keeps its generation batch: the resumed run trains that batch's high pass."""
    from trl_lopti.lopti_mixin import GENERATION_BATCH_FILE

    def run(output_dir, **overrides):
        config = small_config(output_dir, lopti_threshold=ETA_FROM_EACH_BATCH, max_steps=4, **FLOAT64, **overrides)
        return mid_gap_trainer(
            model=tiny_float64_model_path,
            reward_funcs=length_reward,
            args=config,
            train_dataset=conversational_dataset(),
        )

    uninterrupted = run(tmp_path / "whole", save_strategy="steps", save_steps=1)
    initial = {name: p.detach().clone() for name, p in uninterrupted.model.named_parameters()}
    stored_before_push, save_rng_state = {}, uninterrupted._save_rng_state

    def save_rng_state_and_look(output_dir):  # transformers saves the RNG state, then pushes the checkpoint
        stored_before_push[os.path.basename(output_dir)] = os.path.isfile(
            os.path.join(output_dir, GENERATION_BATCH_FILE.format(0))
        )
        save_rng_state(output_dir)

    uninterrupted._save_rng_state = save_rng_state_and_look
    uninterrupted.train()
    checkpoint = tmp_path / "whole" / "checkpoint-3"  # after the low pass of the second generation batch
    assert (checkpoint / GENERATION_BATCH_FILE.format(0)).is_file()
    assert stored_before_push == {
        "checkpoint-1": True,
        "checkpoint-2": False,
        "checkpoint-3": True,
        "checkpoint-4": False,
    }
    assert not (tmp_path / "whole" / "checkpoint-2" / GENERATION_BATCH_FILE.format(0)).exists()  # between batches

    resumed = run(tmp_path / "resumed")
    generations = []
    generate = resumed._generate_and_score_completions
    resumed._generate_and_score_completions = lambda inputs: generations.append(1) or generate(inputs)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4 and generations == [], "the high pass of the stored batch, no generation"
    assert "lopti/loss_high_pass" in next(e for e in resumed.state.log_history if e.get("step") == 4)
    difference, moved = assert_parameters_close(
        dict(resumed.model.named_parameters()), dict(uninterrupted.model.named_parameters()), initial, atol=1e-8
    )
    # the measured figure, for the record (pytest -s)
    print(f"resumed vs uninterrupted: largest difference {difference:.3g} (moved {moved:.3g} in all)")  # noqa: T201
    assert moved > 1e-3
    assert_no_nan_in_logs(resumed)


def test_completions_are_logged_as_trl_logs_them(tiny_model_path, tmp_path, mid_gap_trainer):
    """TRL writes the completions table at every log: each optimizer step of a generation batch, both passes here,
    shows that batch's completions."""
    import pandas as pd

    config = small_config(tmp_path, lopti_threshold=ETA_FROM_EACH_BATCH, log_completions=True, max_steps=4)
    train(tiny_model_path, config, trainer_class=mid_gap_trainer)
    tables = sorted((tmp_path / "completions").glob("completions_*.parquet"))
    # 4 optimizer steps = 2 generation batches (a low pass and a high pass each).
    assert [path.name for path in tables] == [f"completions_0000{step}.parquet" for step in (1, 2, 3, 4)]
    completions = [pd.read_parquet(path)["completion"].astype(str).tolist() for path in tables]
    # per_device_train_batch_size 4 x steps_per_generation 2
    assert [len(table) for table in completions] == [8, 8, 8, 8]
    assert completions[0] == completions[1] and completions[2] == completions[3]
    assert completions[0] != completions[2]


def test_low_token_share_is_logged_once_per_generation_batch_over_the_whole_batch(
    tiny_model_path, tmp_path, mid_gap_trainer
):
    config = small_config(tmp_path, lopti_threshold=ETA_FROM_EACH_BATCH, max_steps=4)
    trainer, _ = train(tiny_model_path, config, trainer_class=mid_gap_trainer)
    rows = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert ["lopti/low_token_share" in row for row in rows] == [True, False, True, False]
    assert ["lopti/ar_weight_mean" in row for row in rows] == [True, False, True, False]
    # the last value is the share over every micro-batch of the last generation batch
    micro_batches = trainer._buffered_inputs
    log_eta = math.log(mid_gap_trainer.etas[-1])  # compared in log space
    low = sum(int(((b["old_per_token_logps"] < log_eta) * b["completion_mask"]).sum()) for b in micro_batches)
    assert 0 < low < sum(int(b["completion_mask"].sum()) for b in micro_batches)
    total = sum(int(b["completion_mask"].sum()) for b in micro_batches)
    assert rows[2]["lopti/low_token_share"] == pytest.approx(low / total, abs=1e-6)
    weights = sum(
        float(((0.3 * b["old_per_token_logps"].exp() + 0.7) * b["completion_mask"]).sum()) for b in micro_batches
    )
    assert rows[2]["lopti/ar_weight_mean"] == pytest.approx(weights / total, rel=1e-5)


def test_model_card_credits_the_method_and_its_settings(tiny_model_path, tmp_path):
    config = small_config(tmp_path, advantage_reweighting_alpha=0.3, lopti_threshold=0.4, max_steps=1)
    trainer = LoptiGRPOTrainer(
        model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )
    trainer.create_model_card(model_name="kk-lopti")
    card = (tmp_path / "README.md").read_text()
    assert (
        "This model was trained with GRPO with Advantage Reweighting (alpha=0.3) and Low-Probability Token "
        "Isolation (Lopti, eta=0.4, low tokens first), a method introduced in [Do Not Let Low-Probability "
        "Tokens Over-Dominate in RL for LLMs](https://huggingface.co/papers/2505.12929)"
    ) in card
    assert "eprint       = {arXiv:2505.12929}" in card  # the method's BibTeX
    assert "eprint       = {arXiv:2402.03300}" in card  # and GRPO's, the base it builds on
    assert "method introduced in [DeepSeekMath" not in card


def test_reinforce_plus_plus_trains_on_batch_whitened_advantages(tiny_model_path, tmp_path, mid_gap_trainer):
    """REINFORCE++ with AR and Lopti: the trained advantages are the token-whitened rewards (no group baseline)."""
    import numpy as np

    records, rewards = [], []

    def reward(completions, **kwargs):
        values = length_reward(completions)
        rewards.extend(values)
        return values

    config = small_config(
        tmp_path,
        advantage_estimator="reinforce_plus_plus",
        advantage_reweighting_alpha=0.1,
        lopti_threshold=ETA_FROM_EACH_BATCH,
        beta=0.05,
    )
    trainer = mid_gap_trainer(
        model=tiny_model_path, reward_funcs=reward, args=config, train_dataset=conversational_dataset()
    )
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        rewards.clear()
        output = generate(inputs)
        records.append((list(rewards), output["completion_mask"].sum(1).numpy(), output["advantages"].numpy()))
        return output

    trainer._generate_and_score_completions = recorded
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert changed_parameters(trainer, initial) == set(initial)
    assert_no_nan_in_logs(trainer)
    assert len(records) == 2
    for batch_rewards, lengths, advantages in records:
        token_returns = np.repeat(batch_rewards, lengths)
        assert token_returns.std() > 0
        expected = (np.array(batch_rewards) - token_returns.mean()) / np.sqrt(token_returns.var(ddof=1) + 1e-8)
        # TRL's rewards and so the advantages are float32 whatever the model's dtype: ~100 float32 ulps
        np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-6)
    # the completions table shows the advantages trained on
    np.testing.assert_allclose(list(trainer._logs["advantages"]), records[-1][2], rtol=1e-6)


@pytest.mark.parametrize("eta, empty", [(0.999, "high"), (1e-9, "low")])
def test_a_group_empty_in_every_batch_so_far_is_warned_about_once(tiny_model_path, tmp_path, eta, empty):
    """A fixed eta above (below) every token a random model samples: every high (low) pass has zero gradient, said once
    after the first 3 generation batches."""
    config = small_config(tmp_path, lopti_threshold=eta, max_steps=8)  # 4 generation batches
    with pytest.warns(
        UserWarning, match=rf"no completion token was {empty} .* in any of the first 3 generation"
    ) as seen:
        trainer, _ = train(tiny_model_path, config)
    messages = [str(w.message) for w in seen if "in any of the first 3 generation batches" in str(w.message)]
    assert len(messages) == 1 and f"every {empty} pass had zero gradient" in messages[0]
    assert "lopti_quantile" in messages[0]
    shares = logged(trainer, "lopti/low_token_share")
    assert len(shares) == 4 and set(shares) == {1.0 if empty == "high" else 0.0}


def test_a_split_batch_gets_no_empty_group_warning(tiny_model_path, tmp_path, mid_gap_trainer):
    config = small_config(tmp_path, lopti_threshold=ETA_FROM_EACH_BATCH, max_steps=6)  # 3 generation batches
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Lopti: no completion token")
        train(tiny_model_path, config, trainer_class=mid_gap_trainer)


def test_the_trainer_says_once_what_max_steps_means_under_lopti(tiny_model_path, tmp_path, caplog):
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_info()
    transformers_logging.enable_propagation()
    try:
        with caplog.at_level("INFO", logger="trl_lopti.lopti_mixin"):
            LoptiGRPOTrainer(
                model=tiny_model_path,
                reward_funcs=length_reward,
                args=small_config(tmp_path),
                train_dataset=conversational_dataset(),
            )
    finally:
        transformers_logging.disable_propagation()
        transformers_logging.set_verbosity_warning()
    said = [record.getMessage() for record in caplog.records if record.name == "trl_lopti.lopti_mixin"]
    assert len(said) == 1 and "2 optimizer steps per batch, 1 without Lopti" in said[0]
    assert "buys half the rollouts it buys GRPOTrainer" in said[0]


def test_a_generation_batchs_split_metrics_land_on_the_row_of_its_reward(tiny_model_path, tmp_path, mid_gap_trainer):
    """steps_per_generation 4 over 2 accumulation steps: TRL computes pi_old at generation, so the batch is split
    there, and its lopti/* metrics land on the log row of its reward (one row per generation batch for W&B)."""
    config = small_config(tmp_path, steps_per_generation=4, lopti_threshold=ETA_FROM_EACH_BATCH, max_steps=8)
    trainer, _ = train(tiny_model_path, config, trainer_class=mid_gap_trainer)
    rows = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(rows) == 8  # 2 generation batches: 2 optimizer steps per pass
    for key in ("reward", "lopti/low_token_share", "lopti/ar_weight_mean", "lopti/threshold"):
        assert [key in row for row in rows] == [True, False, False, False] * 2, key
