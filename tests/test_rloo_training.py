"""Real training runs of LoptiRLOOTrainer on a tiny random Qwen2 (CPU): passes counted, degenerate batches, a resume
between the two passes, the completions table at every log (as TRL writes it), the split metrics once per generation
batch."""

import os

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
    mid_gap_eta_trainer,
    small_config,
)
from trl import RLOOConfig, RLOOTrainer

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer, LoptiRLOOConfig, LoptiRLOOTrainer
from trl_lopti.lopti_mixin import GENERATION_BATCH_FILE


def rloo_config(output_dir, config_class=None, **overrides):
    """`small_config` of a LoptiRLOOConfig (or `config_class`, e.g. TRL's RLOOConfig)."""

    return small_config(output_dir, config_class=config_class or LoptiRLOOConfig, **overrides)


@pytest.fixture
def mid_gap_rloo():
    """A LoptiRLOOTrainer whose eta for each generation batch lies half-way in a wide gap of its pi_old (`mid_gap_eta_trainer`)."""
    return mid_gap_eta_trainer(LoptiRLOOTrainer)


def count_passes(trainer_class, model_path, output_dir, config):
    trainer = trainer_class(
        model=model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )
    counter = PolicyPassCounter(trainer.model)
    trainer.train()
    return trainer, counter


def test_forward_and_backward_counts_per_generation_batch(tiny_model_path, tmp_path, mid_gap_rloo):
    """RLOO computes pi_old at every generation: AR, Lopti and the quantile rule add no forward pass; Lopti doubles
    the forward+backward passes (two optimizer schedules per generation batch)."""
    batches = 2
    _, rloo = count_passes(
        RLOOTrainer, tiny_model_path, tmp_path / "rloo", rloo_config(tmp_path, RLOOConfig, max_steps=batches)
    )
    counts = {"rloo": (rloo.forwards_with_grad, rloo.forwards_without_grad, rloo.backwards)}
    runs = {
        "ar": (LoptiRLOOTrainer, dict(lopti_threshold=None, max_steps=batches)),
        "lopti": (mid_gap_rloo, dict(advantage_reweighting_alpha=0.0, lopti_threshold=ETA_FROM_EACH_BATCH)),
        "ar+lopti": (mid_gap_rloo, dict(lopti_threshold=ETA_FROM_EACH_BATCH)),
        "quantile": (LoptiRLOOTrainer, dict(lopti_quantile=0.4)),
    }
    for name, (trainer_class, fields) in runs.items():
        fields = {"max_steps": 2 * batches, **fields}
        trainer, counter = count_passes(
            trainer_class, tiny_model_path, tmp_path / name, rloo_config(tmp_path, **fields)
        )
        assert trainer.state.global_step == fields["max_steps"]
        counts[name] = (counter.forwards_with_grad, counter.forwards_without_grad, counter.backwards)
    grads, no_grads, backwards = counts["rloo"]
    # per generation batch of 8 completions: 2 micro-steps, and RLOO's pi_old forward in 2 chunks of 4
    assert (grads, no_grads) == (2 * batches, 2 * batches), counts
    assert counts["ar"] == counts["rloo"], "AR adds no pass"
    # Lopti: twice the gradient passes; the only extra no-grad forward is the fixture's own eta (one per batch)
    assert counts["lopti"] == (2 * grads, no_grads + batches, 2 * backwards), counts
    assert counts["ar+lopti"] == counts["lopti"], counts
    assert counts["quantile"] == (2 * grads, no_grads, 2 * backwards), "the quantile reads RLOO's own pi_old"


@pytest.mark.parametrize(
    "case, overrides",
    [
        ("no low tokens", dict(lopti_threshold=1e-6)),
        ("no high tokens", dict(lopti_threshold=0.999)),
        ("empty completions", dict(mask_truncated_completions=True, max_completion_length=2)),
        ("all rewards equal", dict(lopti_threshold=ETA_FROM_EACH_BATCH)),
    ],
)
def test_degenerate_batches_do_not_produce_nan(tiny_model_path, tmp_path, mid_gap_rloo, case, overrides):
    reward = (lambda completions, **kwargs: [1.0] * len(completions)) if case == "all rewards equal" else length_reward
    trainer_class = mid_gap_rloo if case == "all rewards equal" else LoptiRLOOTrainer
    trainer = trainer_class(
        model=tiny_model_path,
        reward_funcs=reward,
        args=rloo_config(tmp_path, beta=0.05, **overrides),
        train_dataset=conversational_dataset(),
    )
    counter = PolicyPassCounter(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 4
    assert_no_nan_in_logs(trainer)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    if case in ("no low tokens", "no high tokens"):
        # the empty pass is an ordinary pass (as the authors run it) whose gradient is zero
        assert counter.forwards_with_grad == 2 * 2 * 2
        empty = 0 if case == "no low tokens" else 1
        assert logged(trainer, "grad_norm")[empty::2] == [0.0, 0.0]
        assert all(value > 0 for value in logged(trainer, "grad_norm")[1 - empty :: 2])


def test_resume_between_the_two_passes_continues_the_batch_to_the_uninterrupted_parameters(
    tiny_float64_model_path, tmp_path, mid_gap_rloo, float64_norms
):
    def run(output_dir, **overrides):
        config = rloo_config(output_dir, lopti_threshold=ETA_FROM_EACH_BATCH, **FLOAT64, **overrides)
        return mid_gap_rloo(
            model=tiny_float64_model_path,
            reward_funcs=length_reward,
            args=config,
            train_dataset=conversational_dataset(),
        )

    uninterrupted = run(tmp_path / "whole", save_strategy="steps", save_steps=1)
    initial = {name: p.detach().clone() for name, p in uninterrupted.model.named_parameters()}
    uninterrupted.train()
    checkpoint = tmp_path / "whole" / "checkpoint-3"  # after the low pass of the second generation batch
    assert (checkpoint / GENERATION_BATCH_FILE.format(0)).is_file()
    assert not (tmp_path / "whole" / "checkpoint-2" / GENERATION_BATCH_FILE.format(0)).exists()

    resumed = run(tmp_path / "resumed")
    generations = []
    generate = resumed._generate_and_score_completions
    resumed._generate_and_score_completions = lambda inputs: generations.append(1) or generate(inputs)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4 and generations == [], "the high pass of the stored batch, no generation"
    difference, moved = assert_parameters_close(
        dict(resumed.model.named_parameters()), dict(uninterrupted.model.named_parameters()), initial, atol=1e-8
    )
    print(f"RLOO resumed vs uninterrupted: largest difference {difference:.3g} (moved {moved:.3g})")  # noqa: T201
    assert moved > 1e-3 and os.path.isdir(checkpoint)


def test_completions_table_at_every_log_and_split_metrics_once_per_generation_batch(
    tiny_model_path, tmp_path, mid_gap_rloo, monkeypatch
):
    import trl.trainer.rloo_trainer as rloo_module

    printed = []
    monkeypatch.setattr(rloo_module, "print_prompt_completions_sample", lambda *args, **kwargs: printed.append(args))
    config = rloo_config(tmp_path, lopti_threshold=ETA_FROM_EACH_BATCH, log_completions=True)
    trainer = mid_gap_rloo(
        model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )
    trainer.train()
    # 4 optimizer steps = 2 generation batches (low pass, high pass each): a table at every log, as TRL prints it,
    # the training's closing summary included. The global step each table was printed at:
    steps_printed = [args[4] for args in printed]
    assert steps_printed == [1, 2, 3, 4, 4], steps_printed
    rows = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert ["lopti/low_token_share" in row for row in rows] == [True, False, True, False]
    assert ["lopti/ar_weight_mean" in row for row in rows] == [True, False, True, False]
    assert ["lopti/loss_low_pass" in row for row in rows] == [True, False, True, False]
    assert ["lopti/loss_high_pass" in row for row in rows] == [False, True, False, True]
    assert 0 < rows[0]["lopti/low_token_share"] < 1
    assert rows[0]["lopti/threshold"] == pytest.approx(mid_gap_rloo.etas[0])
    assert trainer._name.startswith("RLOO with Advantage Reweighting")  # the model card's "trained with"


def test_evaluation_reports_the_split_and_trains_nothing(tiny_model_path, tmp_path):
    config = rloo_config(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    trainer = LoptiRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=length_reward,
        args=config,
        train_dataset=conversational_dataset(),
        eval_dataset=conversational_dataset(4),
    )
    trainer.train()
    evaluation = next(entry for entry in trainer.state.log_history if "eval_loss" in entry)
    assert 0 <= evaluation["eval_lopti/low_token_share"] <= 1 and "eval_lopti/threshold" in evaluation
    assert not any(key.startswith("eval_lopti/loss_") for key in evaluation), "no pass in evaluation"
    assert_no_nan_in_logs(trainer)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.evaluate()
    assert all(torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters())


@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
def test_each_pass_logs_the_loss_the_trainer_logs(tiny_model_path, tmp_path, trainer_name):
    """`lopti/loss_<group>_pass` is TRL's loss on its optimizer step's scale (GRPO divides its micro-step loss by the
    gradient accumulation, RLOO leaves that to the Trainer): equal to the Trainer's `loss` at every step."""
    trainer_class = {"grpo": LoptiGRPOTrainer, "rloo": LoptiRLOOTrainer}[trainer_name]
    config_class = {"grpo": LoptiGRPOConfig, "rloo": LoptiRLOOConfig}[trainer_name]
    config = rloo_config(tmp_path, config_class=config_class, lopti_threshold=0.999)  # gradient accumulation 2
    assert config.gradient_accumulation_steps == 2
    trainer = trainer_class(
        model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )
    trainer.train()
    rows = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(rows) == 4
    for row, group in zip(rows, ["low", "high", "low", "high"], strict=True):
        assert row[f"lopti/loss_{group}_pass"] == pytest.approx(row["loss"], rel=1e-4, abs=1e-6), row
    assert any(abs(row["loss"]) > 1e-4 for row in rows), "a loss that tells the scales apart"
