"""The Lopti split, once per generation batch: the quantile rule (eta at a quantile of the whole batch's pi_old, on
every process), and the empty pass as the paper's authors run it (an ordinary optimizer step with a zero gradient)."""

import copy
import math
from typing import ClassVar

import pytest
import torch
from reference_grpo import reference_grpo_loss
from testing_utils import (
    ALPHA,
    ETA_FROM_EACH_BATCH,
    LEARNING_RATE,
    PolicyPassCounter,
    completion_logps,
    conversational_dataset,
    fixed_generation,
    fixed_generation_batch,
    in_pass,
    length_reward,
    logged,
    micro_batches_as_generated,
    quantile_config,
    quantile_generation_batch,
    run_one_cycle,
    small_config,
    threshold_between_values,
    torchrun,
)
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOTrainer

from trl_lopti import LoptiGRPOTrainer
from trl_lopti.core_algos import lopti_batch_threshold, low_probability_token_mask
from trl_lopti.lopti_mixin import ETA_KEY


ROWS = 8  # completions per generation batch


# ------------------------------------------------------------------------------------------------ the batch's eta
def test_batch_threshold_is_the_quantile_of_the_probabilities_of_the_real_tokens():
    generator = torch.Generator().manual_seed(0)
    logps = -3 * torch.rand(5, 7, generator=generator, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=generator) < 0.7
    padded = torch.where(mask, logps, torch.zeros_like(logps))  # padding at p = 1 would pull the quantile up
    for quantile in (0.1, 0.37, 0.5, 0.9):
        expected = torch.quantile(logps[mask].exp(), quantile)  # probabilities, not log-probabilities
        assert lopti_batch_threshold(padded, mask, quantile) == pytest.approx(float(expected), rel=1e-15)
    assert lopti_batch_threshold(logps, torch.zeros_like(mask), 0.3) == 0.0  # no token: nothing is low


def test_tokens_tied_at_the_quantile_stay_high():
    # eta lands on a block of equal probabilities: pi_old < eta leaves the block high, as in the authors' split
    candidates = -torch.linspace(0.01, 3.0, 3000)
    x = next(float(v) for v in candidates if float(v) < math.log(float(torch.exp(v))))  # log space: the block low
    logps = torch.tensor([[x - 1.0, x, x, x + 0.5, x - 1.0], [x, x + 0.5, x - 1.0, x, x + 0.5]])
    mask = torch.ones_like(logps)
    eta = lopti_batch_threshold(logps, mask, 0.5)  # ordered position 4.5 of 10: inside the tied block of 4
    assert eta == float(torch.exp(torch.tensor(x)))
    low = low_probability_token_mask(logps, mask, eta)
    assert torch.equal(low, logps < x - 0.5) and int(low.sum()) == 3


def quantile_between_tokens(probabilities: torch.Tensor) -> float:
    """A quantile level whose linearly interpolated value lies half-way in a wide gap between two token values."""
    ordered = torch.sort(probabilities.flatten()).values
    midpoint = threshold_between_values(ordered)  # the testing_utils rule: half-way in a wide gap
    below = int((ordered < midpoint).sum()) - 1
    return (below + 0.5) / (ordered.numel() - 1)  # interpolates ordered[below], ordered[below + 1] at one half


# ------------------------------------------------------------------------------------------------ one cycle by hand
def hand_run_cycle(initial_model, micro_batches, config, threshold_of_micro_batch):
    """Low pass then high pass by hand (SGD), every pass the whole schedule, ratio against the same pi_old."""
    model = copy.deepcopy(initial_model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    with torch.no_grad():
        old_logps = [completion_logps(model, micro_batch) for micro_batch in micro_batches]
    num_items = sum(int(micro_batch["completion_mask"].sum()) for micro_batch in micro_batches)
    for token_group in ("low", "high"):
        for index, micro_batch in enumerate(micro_batches):
            mask = micro_batch["completion_mask"].bool()
            low = (old_logps[index].exp() < threshold_of_micro_batch(index)) & mask
            active = low if token_group == "low" else mask & ~low
            advantages = micro_batch["advantages"][:, None] * (ALPHA * old_logps[index].exp() + 1 - ALPHA)
            logps = completion_logps(model, micro_batch)
            loss = reference_grpo_loss(
                logps,
                torch.zeros_like(logps),
                old_logps[index],
                advantages,
                mask.double(),
                loss_type="dapo",
                epsilon_low=config.epsilon,
                epsilon_high=config.epsilon_high or config.epsilon,
                num_items_in_batch=num_items,
                gradient_accumulation_steps=config.gradient_accumulation_steps,
                steps_per_generation=config.steps_per_generation,
                grad_mask=active.double(),
            )
            loss.backward()
            if (index + 1) % config.gradient_accumulation_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    return model


def largest_difference(model_a, model_b) -> float:
    return max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True)
    )


def whole_batch_quantile(tiny_model_path):
    """The fixed batch, a float64 copy of the initial model, and a quantile level robust for the whole batch."""
    initial_model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    batch = quantile_generation_batch(initial_model.config.vocab_size, ROWS)
    with torch.no_grad():
        probabilities = completion_logps(initial_model, batch).exp()[batch["completion_mask"].bool()]
    return initial_model, batch, quantile_between_tokens(probabilities)


@pytest.mark.parametrize(
    "gradient_accumulation_steps, steps_per_generation",
    [(2, 2), (1, 2)],
    ids=["pi_old-forward-made-for-the-quantile", "two-optimizer-steps-per-pass"],
)
def test_one_quantile_cycle_equals_hand_run_with_eta_of_the_whole_batch(
    tiny_model_path,
    tmp_path,
    monkeypatch,
    single_thread,
    float64_norms,
    gradient_accumulation_steps,
    steps_per_generation,
):
    initial_model, batch, quantile = whole_batch_quantile(tiny_model_path)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", fixed_generation(batch))
    config = quantile_config(str(tmp_path), ROWS, gradient_accumulation_steps, steps_per_generation, quantile)
    trainer = run_one_cycle(tiny_model_path, config, batch)

    micro_batches = micro_batches_as_generated(trainer, batch)
    assert len(micro_batches) == steps_per_generation > 1
    with torch.no_grad():
        old = [completion_logps(initial_model, micro_batch) for micro_batch in micro_batches]
    probabilities = [logps.exp()[mb["completion_mask"].bool()] for logps, mb in zip(old, micro_batches, strict=True)]
    whole_eta = float(torch.quantile(torch.cat(probabilities), quantile))
    micro_batch_etas = [float(torch.quantile(p, quantile)) for p in probabilities]
    assert [entry["lopti/threshold"] for entry in trainer.state.log_history if "lopti/threshold" in entry] == (
        pytest.approx([whole_eta], rel=1e-12)
    ), "eta logged once per generation batch"
    splits_differ = any(
        ((p < whole_eta) != (p < eta)).any() for p, eta in zip(probabilities, micro_batch_etas, strict=True)
    )
    assert splits_differ, "the batch must tell the whole-batch quantile from per-micro-batch quantiles"

    expected = hand_run_cycle(initial_model, micro_batches, config, lambda index: whole_eta)
    per_micro_batch = hand_run_cycle(initial_model, micro_batches, config, lambda index: micro_batch_etas[index])
    difference = largest_difference(trainer.model, expected)
    power = largest_difference(trainer.model, per_micro_batch)
    moved = largest_difference(expected, initial_model)
    print(  # noqa: T201 - the measured figures, for the record (pytest -s)
        f"quantile {quantile:.4f}: |trainer - hand run, whole-batch eta| = {difference:.2e}, "
        f"|trainer - hand run, per-micro-batch eta| = {power:.2e}, moved {moved:.2e}"
    )
    assert difference < 1e-8  # float64 throughout (testing_utils.use_exact_log_prob_head)
    assert power > 1e-4
    assert moved > 1e-3


def test_low_plus_high_is_plain_grpo_on_a_batch_split_at_its_quantile(tiny_model_path, tmp_path, monkeypatch):
    _, batch, quantile = whole_batch_quantile(tiny_model_path)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", fixed_generation(batch))
    trainer = run_one_cycle(tiny_model_path, quantile_config(str(tmp_path), ROWS, 2, 2, quantile), batch)
    trainer.model.train()
    micro_batch = trainer._buffered_inputs[0]  # split with the whole batch's eta
    eta = float(micro_batch[ETA_KEY])
    low = (micro_batch["old_per_token_logps"].exp() < eta) & micro_batch["completion_mask"].bool()
    assert low.any() and (micro_batch["completion_mask"].bool() & ~low).any(), "neither pass is empty"
    gradients = {}
    for token_group in ("low", "high", None):
        trainer.model.zero_grad(set_to_none=True)
        with in_pass(trainer, token_group):
            trainer.compute_loss(trainer.model, micro_batch).backward()
        gradients[token_group] = [p.grad.detach().clone() for p in trainer.model.parameters()]
    for low_pass, high_pass, plain in zip(gradients["low"], gradients["high"], gradients[None], strict=True):
        torch.testing.assert_close(low_pass + high_pass, plain, rtol=1e-6, atol=1e-10)
    assert max(float(g.abs().max()) for g in gradients["low"]) > 1e-4
    assert max(float(g.abs().max()) for g in gradients["high"]) > 1e-4


def test_a_quantile_alone_trains_at_one_no_grad_forward_per_generation_batch(tiny_model_path, tmp_path):
    """Real generation, on-policy (TRL computes no pi_old): the trainer runs one no-grad forward per generation batch."""
    config = small_config(tmp_path, lopti_quantile=0.4, max_steps=4)
    trainer = LoptiGRPOTrainer(
        model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )
    counter = PolicyPassCounter(trainer.model)
    trainer.train()
    # 4 optimizer steps = 2 generation batches, each read once without grad (in 2 chunks of per_device_train_batch_size)
    assert counter.forwards_without_grad == 2 * 2
    assert counter.forwards_with_grad == 8  # 2 batches x 2 passes x 2 micro-steps
    entries = trainer._buffered_inputs
    logps = torch.cat([entry["old_per_token_logps"][entry["completion_mask"].bool()] for entry in entries])
    thresholds = logged(trainer, "lopti/threshold")
    assert len(thresholds) == 2
    assert thresholds[-1] == pytest.approx(float(torch.quantile(logps.exp(), 0.4)), rel=1e-6)
    assert all(float(entry[ETA_KEY]) == pytest.approx(thresholds[-1], rel=1e-6) for entry in entries)


def test_fixed_eta_needs_no_forward_but_trls_pi_old_and_logs_it(tiny_model_path, tmp_path):
    """The one forward without gradient is TRL's own pi_old at generation (the batch spans both passes' optimizer
    steps), in micro-batches of per_device_train_batch_size: steps_per_generation forwards for one batch."""
    config = small_config(tmp_path, lopti_threshold=ETA_FROM_EACH_BATCH, max_steps=2)
    trainer = LoptiGRPOTrainer(
        model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )
    counter = PolicyPassCounter(trainer.model)
    trainer.train()
    assert counter.forwards_without_grad == config.steps_per_generation
    assert logged(trainer, "lopti/threshold") == [ETA_FROM_EACH_BATCH]


@pytest.mark.slow
def test_two_process_ddp_gives_the_eta_and_parameters_of_one_process(
    tiny_model_path, tmp_path, monkeypatch, float64_norms
):
    initial_model, batch, quantile = whole_batch_quantile(tiny_model_path)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", fixed_generation(batch))
    one_process = run_one_cycle(tiny_model_path, quantile_config(str(tmp_path / "one"), ROWS, 2, 2, quantile), batch)
    result_path = tmp_path / "ddp.pt"
    torchrun(
        "ddp_quantile_script.py",
        2,
        tiny_model_path,
        str(tmp_path / "two"),
        str(result_path),
        str(quantile),
        str(ROWS // 2),
    )
    ddp = torch.load(result_path)
    assert ddp["world_size"] == 2 and "MULTI_CPU" in ddp["distributed_type"]
    with torch.no_grad():
        probabilities = completion_logps(initial_model, batch).exp()[batch["completion_mask"].bool()]
    one_eta = [e["lopti/threshold"] for e in one_process.state.log_history if "lopti/threshold" in e]
    assert one_eta == pytest.approx([float(torch.quantile(probabilities, quantile))], rel=1e-12)
    assert ddp["thresholds"] == pytest.approx(one_eta, rel=1e-12)
    difference = max(
        float((p.detach() - ddp["parameters"][name]).abs().max()) for name, p in one_process.model.named_parameters()
    )
    # the measured figure, for the record (pytest -s)
    print(f"|one process - two processes| = {difference:.2e}")  # noqa: T201
    assert difference < 1e-8  # float64 throughout; the two runs sum gradients in another order
    assert largest_difference(one_process.model, initial_model) > 1e-3


# ------------------------------------------------------------------------------------------------ the empty pass
class KeepOptimizerState(TrainerCallback):
    """Copies the parameters and the optimizer's state after the first optimizer step."""

    def __init__(self):
        self.trainer = self.parameters = self.optimizer_state = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.parameters = [p.detach().clone() for p in self.trainer.model.parameters()]
            self.optimizer_state = copy.deepcopy(self.trainer.optimizer.state_dict())


@pytest.mark.parametrize("token_group", ["low", "high"])
def test_a_micro_batch_without_its_split_or_pi_old_stops_rather_than_split_at_the_moved_policy(
    tiny_model_path, tmp_path, token_group
):
    """Under Lopti each micro-batch carries its generation's split: one that reaches the loss with neither the split nor
    pi_old would take the current (moved) policy for pi_old, so the loss stops on fact S1. With pi_old alone, it is
    split from that pi_old (a batch made elsewhere)."""
    config = small_config(tmp_path, lopti_threshold=ETA_FROM_EACH_BATCH, max_steps=2)
    trainer = LoptiGRPOTrainer(
        model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )
    batch, _ = fixed_generation_batch(tiny_model_path, 4, seed=0, beta=0.0)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    with in_pass(trainer, token_group), pytest.raises(RuntimeError) as error:
        trainer.compute_loss(trainer.model, dict(batch))
    message = str(error.value)
    assert "broke fact S1 of trl_lopti (Schedule): a micro-batch reached the loss without the split" in message
    with torch.no_grad():
        batch["old_per_token_logps"] = completion_logps(trainer.model, batch)
    with in_pass(trainer, token_group):
        assert torch.isfinite(trainer.compute_loss(trainer.model, dict(batch)))


def test_an_empty_pass_is_an_adamw_step_with_zero_gradient(tiny_model_path, tmp_path):
    """No high token: the high pass still steps AdamW (momentum and weight decay move the weights), as the authors."""
    config = small_config(
        tmp_path,
        lopti_threshold=0.999,
        max_steps=2,
        optim="adamw_torch",
        weight_decay=0.1,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        model_init_kwargs={"dtype": torch.float64},
    )
    trainer = LoptiGRPOTrainer(
        model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )
    keep = KeepOptimizerState()
    keep.trainer = trainer
    trainer.add_callback(keep)
    trainer.train()
    assert logged(trainer, "lopti/low_token_share") == [1.0]
    assert logged(trainer, "grad_norm")[1] == 0.0
    # the same AdamW step from the state after the low pass, with a zero gradient, by hand
    replay = [p.clone().requires_grad_(True) for p in keep.parameters]
    index = {id(p): i for i, p in enumerate(trainer.model.parameters())}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [replay[index[id(p)]] for p in g["params"]]}
        for g in trainer.optimizer.param_groups
    ]
    optimizer = torch.optim.AdamW(groups)
    optimizer.load_state_dict(keep.optimizer_state)
    for parameter in replay:
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    moved = 0
    for parameter, before, expected in zip(trainer.model.parameters(), keep.parameters, replay, strict=True):
        torch.testing.assert_close(parameter.detach(), expected.detach(), atol=1e-12, rtol=0)
        moved += int(not torch.equal(parameter.detach(), before))
    assert moved == len(keep.parameters), "every parameter moves in the empty pass"


def test_adaptive_entropy_controller_updates_once_per_optimizer_step_empty_passes_included(tiny_model_path, tmp_path):
    config = small_config(
        tmp_path,
        lopti_threshold=0.999,
        max_steps=6,
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_coef_delta=0.005,
        entropy_target=1e6,
        entropy_coef_max=1.0,
    )
    trainer = LoptiGRPOTrainer(
        model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )
    trainer.train()
    assert trainer.entropy_coef == pytest.approx(0.01 + 0.005 * 6)  # entropy below the target: +delta per step
    assert logged(trainer, "lopti/low_token_share") == [1.0, 1.0, 1.0]  # three empty high passes


def test_the_method_description_names_the_split_rule(tmp_path):
    from trl_lopti.lopti_mixin import describe_method

    config = quantile_config(str(tmp_path), ROWS, 2, 2, 0.3)
    assert describe_method(config, "GRPO") == (
        "GRPO with Advantage Reweighting (alpha=0.3) and Low-Probability Token Isolation "
        "(Lopti, eta at the 0.3 quantile of each batch, low tokens first)"
    )


def test_the_method_description_names_the_trainer_a_composition_extends(tmp_path, tiny_model_path):
    """A trainer is described by the trainer it extends (TRL's, or a user's), whatever its config class."""
    from trl import GRPOTrainer

    from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer

    class SequenceMeanTrainer(GRPOTrainer):
        _tag_names: ClassVar[list[str]] = ["trl", "sequence-mean"]

    class LoptiSequenceMeanTrainer(LoptiGRPOTrainer, SequenceMeanTrainer):
        pass

    class MySettings(LoptiGRPOConfig):
        pass

    config = MySettings(output_dir=str(tmp_path), lopti_threshold=None, use_cpu=True, report_to="none")
    runs = ((LoptiGRPOTrainer, "GRPO", "grpo"), (LoptiSequenceMeanTrainer, "SequenceMean", "sequence-mean"))
    for trainer_class, name, tag in runs:
        trainer = trainer_class(tiny_model_path, length_reward, config, conversational_dataset())
        assert trainer._name == f"{name} with Advantage Reweighting (alpha=0.3)"
        assert trainer._tag_names == ["trl", tag, "lopti"]
