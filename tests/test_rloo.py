"""LoptiRLOOTrainer: AR and Lopti on TRL's RLOOTrainer, against an independent RLOO (tests/reference_rloo.py).

At equal parameters: AR's general form and each Lopti pass against the hand-written loss, inactive tokens' gradients
exactly zero, low + high == plain. Whole cycles with real generation (leave-one-out advantages, the KL penalty in the
reward, `normalize_advantages`, clipping, `num_iterations = 2`, the quantile rule) against a hand-run SGD. Both methods
off: exactly `RLOOTrainer`. The figures are printed for the record (`pytest -s`).
"""

import copy
import math

import pytest
import torch
from datasets import Dataset
from reference_grpo import completion_logps_and_entropies
from reference_rloo import clipped_sequences, reference_rloo_loss, rloo_advantages
from testing_utils import (
    FLOAT64,
    assert_parameters_close,
    in_pass,
    micro_batches_as_generated,
    mid_gap_eta_trainer,
    threshold_between_values,
    use_exact_log_prob_head,
)
from transformers import AutoModelForCausalLM
from trl import RLOOConfig, RLOOTrainer

from trl_lopti import LoptiRLOOConfig, LoptiRLOOTrainer
from trl_lopti.lopti_mixin import AR_WEIGHTS_KEY, ETA_KEY, LOW_MASK_KEY
from trl_lopti.tasks import token_parity_reward


TEMPERATURE = 0.7
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
COMPLETION_LENGTH = 7
LEARNING_RATE = 1e-4
GRADIENT_ATOL, GRADIENT_RTOL = 1e-10, 1e-8  # float64 model and log-prob head (conftest)
PARAMETER_ATOL = 1e-12  # float64: the trainer and the hand-run agree to ~1e-17 at these small steps


def constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def move_away_from_the_reference(model, seed: int = 1, scale: float = 0.05) -> None:
    """Perturbs the policy's parameters (seeded), so that RLOO's KL penalty is not zero."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn_like(parameter))


def rloo_config(config_class, output_dir, **fields):
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        epsilon=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        **FLOAT64,
    )
    values.update(fields)
    return config_class(**values)


# ---------------------------------------------------------------------------------------------- equal parameters
@pytest.fixture
def build(tiny_float64_model_path, tmp_path, float64_norms):
    """`build(**fields)`: a float64 LoptiRLOOTrainer (exact log-prob head), moved away from its reference model."""

    def build(peft_config=None, **fields) -> LoptiRLOOTrainer:
        config = rloo_config(LoptiRLOOConfig, tmp_path, **fields)
        trainer = LoptiRLOOTrainer(
            model=tiny_float64_model_path,
            reward_funcs=constant_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}),
            peft_config=peft_config,
        )
        use_exact_log_prob_head(trainer)
        move_away_from_the_reference(trainer.model)
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        return trainer

    return build


def make_batch(trainer, seed: int, noise: float = 0.15, rows: int = 8) -> dict:
    """A micro-batch as LoptiRLOOTrainer's generation leaves it: RLOO's `old_logps` (B,) and the per-token pi_old it
    keeps, off-policy by `noise` per token so that some sequences clip and some do not; with its eta."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = trainer.model.config.vocab_size
    completion_mask = torch.ones(rows, COMPLETION_LENGTH, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    inputs = {
        "prompt_ids": torch.randint(3, vocab_size, (rows, 5), generator=generator),
        "prompt_mask": torch.ones(rows, 5, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab_size, (rows, COMPLETION_LENGTH), generator=generator),
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=generator, dtype=torch.float64),
    }
    with torch.no_grad():
        current, _ = completion_logps_and_entropies(trainer.model, inputs, TEMPERATURE)
    old = current + noise * torch.randn(current.shape, generator=generator, dtype=current.dtype)
    inputs["old_per_token_logps"] = old
    inputs["old_logps"] = (old * completion_mask).sum(1)
    eta = threshold_between_values(old.exp()[completion_mask.bool()])
    inputs[ETA_KEY] = torch.tensor(eta, dtype=torch.float64)
    return inputs


class PolicyOutputs:
    """Keeps the log-probabilities TRL's RLOO policy forward returns, with their gradients."""

    def __init__(self, monkeypatch):
        self.logps = None
        original = RLOOTrainer._get_per_token_logps_and_entropies

        def capture(trainer_self, *args, **kwargs):
            logps, entropies, aux_loss = original(trainer_self, *args, **kwargs)
            if logps.requires_grad:
                logps.retain_grad()
                self.logps = logps
            return logps, entropies, aux_loss

        monkeypatch.setattr(RLOOTrainer, "_get_per_token_logps_and_entropies", capture)


def loss_and_gradients(trainer, inputs: dict, token_group: str | None):
    trainer.model.zero_grad(set_to_none=True)
    with in_pass(trainer, token_group):
        loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    gradients = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


def reference_loss_and_gradients(trainer, inputs: dict, alpha: float, token_group: str | None):
    trainer.model.zero_grad(set_to_none=True)
    logps, _ = completion_logps_and_entropies(trainer.model, inputs, TEMPERATURE)
    old, mask = inputs["old_per_token_logps"], inputs["completion_mask"].bool()
    weights = alpha * old.exp() + 1 - alpha
    if token_group is not None:
        low = (old.exp() < float(inputs[ETA_KEY])) & mask
        weights = weights * (low if token_group == "low" else mask & ~low)
    loss = reference_rloo_loss(
        logps,
        old,
        mask,
        inputs["advantages"],
        epsilon_low=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        token_gradient_weights=weights,
    )
    loss.backward()
    gradients = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


def largest_difference(actual: dict, expected: dict) -> float:
    assert actual.keys() == expected.keys() and expected
    return max(float((actual[name] - expected[name]).abs().max()) for name in expected)


def assert_gradients_close(actual: dict, expected: dict) -> float:
    total = math.sqrt(sum(float(g.pow(2).sum()) for g in expected.values()))
    assert total > 0, "degenerate case: the expected gradient is zero"
    for name, gradient in expected.items():
        torch.testing.assert_close(actual[name], gradient, atol=GRADIENT_ATOL, rtol=GRADIENT_RTOL)
    return largest_difference(actual, expected)


def test_the_test_batch_clips_some_sequences_and_not_others(build):
    trainer = build(advantage_reweighting_alpha=0.0, lopti_threshold=None)
    inputs = make_batch(trainer, seed=11)
    with torch.no_grad():
        logps, _ = completion_logps_and_entropies(trainer.model, inputs, TEMPERATURE)
    clipped = clipped_sequences(
        logps,
        inputs["old_per_token_logps"],
        inputs["completion_mask"],
        inputs["advantages"],
        epsilon_low=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
    )
    assert 0 < int(clipped.sum()) < len(clipped)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_advantage_reweighting_matches_independent_rloo(build, alpha):
    trainer = build(advantage_reweighting_alpha=alpha, lopti_threshold=None)
    inputs = make_batch(trainer, seed=11)
    loss, gradients = loss_and_gradients(trainer, inputs, None)
    expected_loss, expected = reference_loss_and_gradients(trainer, inputs, alpha, None)
    torch.testing.assert_close(loss, expected_loss, atol=GRADIENT_ATOL, rtol=GRADIENT_RTOL)
    difference = assert_gradients_close(gradients, expected)
    print(f"RLOO AR alpha={alpha}: largest |trainer - hand-written| gradient {difference:.3g}")  # noqa: T201


def test_advantage_reweighting_changes_rloos_gradient_and_not_its_loss(build):
    """Guards the test above against a reference that ignores alpha: alpha 0.3 and 0 must differ."""
    reweighting = build(advantage_reweighting_alpha=0.3, lopti_threshold=None)
    plain = build(advantage_reweighting_alpha=0.0, lopti_threshold=None)
    inputs = make_batch(plain, seed=11)
    reweighted_loss, reweighted_gradients = loss_and_gradients(reweighting, inputs, None)
    plain_loss, plain_gradients = loss_and_gradients(plain, inputs, None)
    assert torch.equal(reweighted_loss, plain_loss), "AR changes no value of RLOO's loss"
    assert sum(float((reweighted_gradients[n] - plain_gradients[n]).abs().sum()) for n in plain_gradients) > 1e-4


@pytest.mark.parametrize("alpha", [0.0, 0.3])
@pytest.mark.parametrize("token_group", ["low", "high"])
def test_lopti_pass_matches_independent_rloo(build, alpha, token_group):
    trainer = build(advantage_reweighting_alpha=alpha, lopti_threshold=0.5)
    inputs = make_batch(trainer, seed=5)
    loss, gradients = loss_and_gradients(trainer, inputs, token_group)
    expected_loss, expected = reference_loss_and_gradients(trainer, inputs, alpha, token_group)
    torch.testing.assert_close(loss, expected_loss, atol=GRADIENT_ATOL, rtol=GRADIENT_RTOL)
    difference = assert_gradients_close(gradients, expected)
    print(f"RLOO {token_group} pass, alpha={alpha}: largest |trainer - hand-written| gradient {difference:.3g}")  # noqa: T201


@pytest.mark.parametrize("seed", [7, 11], ids=["batch-7", "batch-11-clipped"])
@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_inactive_tokens_get_exactly_zero_gradient_and_low_plus_high_is_plain_rloo(build, monkeypatch, alpha, seed):
    outputs = PolicyOutputs(monkeypatch)
    trainer = build(advantage_reweighting_alpha=alpha, lopti_threshold=0.5)
    inputs = make_batch(trainer, seed=seed)
    mask = inputs["completion_mask"].bool()
    low = (inputs["old_per_token_logps"].exp() < float(inputs[ETA_KEY])) & mask
    assert 0 < int(low.sum()) < int(mask.sum()), "both groups must be non-empty"
    plain_loss, plain = loss_and_gradients(trainer, inputs, None)
    plain_logp_grad = outputs.logps.grad.clone()
    summed_parameters, summed_logp_grad = None, torch.zeros_like(plain_logp_grad)
    for token_group, active in (("low", low), ("high", mask & ~low)):
        loss, gradients = loss_and_gradients(trainer, inputs, token_group)
        logp_grad = outputs.logps.grad.clone()
        assert torch.count_nonzero(logp_grad[~active]) == 0, f"{token_group} pass leaks to inactive tokens"
        torch.testing.assert_close(logp_grad[active], plain_logp_grad[active], atol=GRADIENT_ATOL, rtol=GRADIENT_RTOL)
        assert torch.equal(loss, plain_loss), "every value of the loss is plain RLOO's"
        summed_logp_grad += logp_grad
        summed_parameters = (
            gradients if summed_parameters is None else {n: summed_parameters[n] + gradients[n] for n in plain}
        )
        assert any(not torch.allclose(gradients[n], plain[n]) for n in plain), "a pass is a part, not the whole"
    torch.testing.assert_close(summed_logp_grad, plain_logp_grad, atol=GRADIENT_ATOL, rtol=GRADIENT_RTOL)
    difference = assert_gradients_close(summed_parameters, plain)
    print(f"RLOO alpha={alpha}, seed {seed}: largest |low + high - plain| gradient {difference:.3g}")  # noqa: T201


def test_lora_gradients_match_independent_rloo_and_low_plus_high_is_plain(build):
    """LoRA through `peft_config`: the adapter's gradients of each pass against the hand-written loss, and their sum."""
    peft = pytest.importorskip("peft", reason="the peft extra (the TRL matrix installs no extra)")

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = build(advantage_reweighting_alpha=0.3, lopti_threshold=0.5, peft_config=lora)
    inputs = make_batch(trainer, seed=7)
    plain_loss, plain = loss_and_gradients(trainer, inputs, None)
    assert plain and all("lora_" in name for name in plain), "only the adapter trains"
    summed, differences = {name: torch.zeros_like(g) for name, g in plain.items()}, []
    for token_group in ("low", "high"):
        loss, gradients = loss_and_gradients(trainer, inputs, token_group)
        _, expected = reference_loss_and_gradients(trainer, inputs, 0.3, token_group)
        differences.append(assert_gradients_close(gradients, expected))
        summed = {name: summed[name] + gradients[name] for name in plain}
        assert torch.equal(loss, plain_loss)
    difference = assert_gradients_close(summed, plain)
    print(  # noqa: T201
        f"RLOO LoRA: largest |trainer - hand-written| gradient {max(differences):.3g}, "
        f"largest |low + high - plain| {difference:.3g}"
    )


def test_degenerate_micro_batches_give_finite_gradients(build):
    """All-equal rewards (zero advantages), empty completions, a pass with no active token: no NaN."""
    trainer = build(advantage_reweighting_alpha=0.3, lopti_threshold=0.5)
    inputs = make_batch(trainer, seed=2)
    inputs["advantages"] = torch.zeros(8, dtype=torch.float64)
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    inputs["old_logps"] = torch.zeros(8, dtype=torch.float64)
    for token_group in ["low", "high", None]:
        loss, gradients = loss_and_gradients(trainer, inputs, token_group)
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in gradients.values())


# ---------------------------------------------------------------------------------------------- whole cycles
class RecordedReward:
    """token_parity_reward, recording what it returned (the hand-run's rewards: the user's function, not ours)."""

    def __init__(self):
        self.rewards = []
        self.__name__ = "token_parity_reward"

    def __call__(self, completion_ids, **kwargs):
        rewards = token_parity_reward(completion_ids)
        self.rewards.append(torch.tensor(rewards, dtype=torch.float32).double())  # TRL keeps rewards in float32
        return rewards


def run_cycle(model_path, output_dir, *, gradient_accumulation_steps, steps_per_generation, **fields):
    """One Lopti cycle (or one AR step) of a float64 LoptiRLOOTrainer on its own generations, SGD; the trainer, the
    policy it started from, its reference model, the generation batch (rows tagged) and the recorded rewards."""
    trainer_class = mid_gap_eta_trainer(LoptiRLOOTrainer)
    config = rloo_config(
        LoptiRLOOConfig,
        output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        optim="sgd",
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        shuffle_dataset=False,
        seed=3,
        **fields,
    )
    pass_steps = config.lopti_pass_micro_steps // gradient_accumulation_steps
    config.max_steps = config.lopti_num_passes * pass_steps
    reward = RecordedReward()
    dataset = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(8)]})
    trainer = trainer_class(model=model_path, reward_funcs=reward, args=config, train_dataset=dataset)
    use_exact_log_prob_head(trainer)
    move_away_from_the_reference(trainer.model, scale=0.1)
    initial = copy.deepcopy(dict(trainer.model.named_parameters()))
    recorded = []
    generate = trainer._generate_and_score_completions

    def record(inputs):
        output = generate(inputs)
        output["row_id"] = torch.arange(len(output["advantages"]))
        recorded.append({key: value.clone() if torch.is_tensor(value) else value for key, value in output.items()})
        return output

    trainer._generate_and_score_completions = record
    trainer.train()
    assert len(recorded) == 1, "one generation batch per cycle"
    return trainer, initial, recorded[0], reward.rewards[0]


def hand_run(model_path, initial, batch, rewards, trainer, pass_order):
    """The cycle by hand: RLOO's advantages from the rewards, then one SGD schedule per pass over the micro-batches
    in TRL's order, each token's gradient weighted by AR and the pass's active mask. Returns the model, the largest
    share of clipped sequences seen in a micro-step and the gradient norm of each optimizer step."""
    args = trainer.args
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    model.load_state_dict({name: value.detach() for name, value in initial.items()})
    reference_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    mask = batch["completion_mask"]
    with torch.no_grad():
        old, _ = completion_logps_and_entropies(model, batch, TEMPERATURE)
        ref, _ = completion_logps_and_entropies(reference_model, batch, TEMPERATURE)
    torch.testing.assert_close(batch["old_per_token_logps"][mask.bool()], old[mask.bool()], atol=1e-10, rtol=0)
    kl = ((old - ref) * mask).sum(1)
    advantages = rloo_advantages(
        rewards, args.num_generations, kl=kl, beta=args.beta, normalize=args.normalize_advantages
    )
    # the trainer's are TRL's (whose Bessel correction of normalize_advantages is a float32 ratio): the hand-run trains
    # on them once they are RLOO's to that precision
    torch.testing.assert_close(batch["advantages"], advantages, atol=1e-12, rtol=1e-7)
    if args.lopti_quantile is not None:
        expected_eta = torch.quantile(old.exp()[mask.bool()], args.lopti_quantile)
        torch.testing.assert_close(float(batch[ETA_KEY]), float(expected_eta), atol=1e-12, rtol=0)
    eta = float(batch[ETA_KEY]) if ETA_KEY in batch else 0.5
    probabilities = old.exp()[mask.bool()]
    assert float((probabilities - eta).abs().min()) > 1e-9, "no token may sit on eta"
    full = {**batch, "old_per_token_logps": old}
    slices = micro_batches_as_generated(trainer, full)
    alpha, largest_clipped_share, step_gradient_norms = args.advantage_reweighting_alpha, 0.0, []
    for token_group in pass_order:
        for micro_step in range(args.steps_per_generation * args.num_iterations):
            micro = slices[micro_step % args.steps_per_generation]
            micro_mask = micro["completion_mask"].bool()
            weights = alpha * micro["old_per_token_logps"].exp() + 1 - alpha
            if token_group is not None:
                low = (micro["old_per_token_logps"].exp() < eta) & micro_mask
                weights = weights * (low if token_group == "low" else micro_mask & ~low)
            logps, _ = completion_logps_and_entropies(model, micro, TEMPERATURE)
            settings = dict(epsilon_low=args.epsilon, epsilon_high=args.epsilon_high)
            clipped = clipped_sequences(
                logps, micro["old_per_token_logps"], micro_mask, micro["advantages"], **settings
            )
            largest_clipped_share = max(largest_clipped_share, float(clipped.float().mean()))
            loss = reference_rloo_loss(
                logps,
                micro["old_per_token_logps"],
                micro_mask,
                micro["advantages"],
                token_gradient_weights=weights,
                **settings,
            )
            (loss / args.gradient_accumulation_steps).backward()  # the Trainer divides RLOO's loss so
            if (micro_step + 1) % args.gradient_accumulation_steps == 0:
                gradients = [p.grad for p in model.parameters() if p.grad is not None]
                step_gradient_norms.append(math.sqrt(sum(float(g.pow(2).sum()) for g in gradients)))
                with torch.no_grad():
                    for parameter in model.parameters():
                        if parameter.grad is not None:
                            parameter.sub_(LEARNING_RATE * parameter.grad)
                model.zero_grad(set_to_none=True)
    return model, largest_clipped_share, step_gradient_norms


CYCLES = {
    # name: (gradient_accumulation_steps, steps_per_generation, LoptiRLOOConfig fields)
    "ar+lopti, beta>0": (2, 2, dict(advantage_reweighting_alpha=0.3, lopti_threshold=0.5, beta=0.05)),
    "normalize_advantages": (2, 2, dict(advantage_reweighting_alpha=0.3, beta=0.05, normalize_advantages=True)),
    "num_iterations=2": (2, 2, dict(advantage_reweighting_alpha=0.3, beta=0.05, num_iterations=2)),
    # clipping: a sequence of negative advantage whose probability fell at all is clipped (epsilon 1e-6, far below the
    # ~1e-4-1e-2 moves of these steps), one of positive advantage never (epsilon_high 1), so on any stack some sequences
    # clip and every step trains through the others (a symmetric 0.005 sat inside the moves: torch 2.6 clipped all)
    "clipping (epsilon 1e-6)": (1, 2, dict(advantage_reweighting_alpha=0.3, epsilon=1e-6, epsilon_high=1.0)),
    "quantile 0.37": (2, 2, dict(advantage_reweighting_alpha=0.0, lopti_quantile=0.37)),
    "high_first": (1, 2, dict(advantage_reweighting_alpha=0.3, lopti_order="high_first")),
    "ar alone": (2, 2, dict(advantage_reweighting_alpha=0.3, lopti_threshold=None, beta=0.05)),
}


@pytest.mark.parametrize("setting", list(CYCLES))
def test_one_cycle_equals_a_hand_run_of_rloo(tiny_float64_model_path, tmp_path, float64_norms, setting):
    accumulation, steps, fields = CYCLES[setting]
    trainer, initial, batch, rewards = run_cycle(
        tiny_float64_model_path,
        tmp_path,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps,
        **fields,
    )
    args = trainer.args
    assert trainer.state.global_step == args.lopti_num_passes * args.lopti_pass_micro_steps // accumulation
    expected, clipped_share, step_gradient_norms = hand_run(
        tiny_float64_model_path, initial, batch, rewards, trainer, args.lopti_pass_order
    )
    difference, moved = assert_parameters_close(
        dict(trainer.model.named_parameters()), dict(expected.named_parameters()), initial, atol=PARAMETER_ATOL
    )
    print(  # noqa: T201
        f"RLOO cycle [{setting}]: {trainer.state.global_step} optimizer steps, largest |trainer - hand-run| parameter "
        f"{difference:.3g}, moved {moved:.6g}"
    )
    assert moved > 1e-3, "the update must move the parameters"
    assert min(step_gradient_norms) > 1e-6, f"every optimizer step trains (none fully clipped): {step_gradient_norms}"
    if args.lopti_enabled:  # both passes train tokens
        low = trainer._buffered_inputs[0][LOW_MASK_KEY]
        every_low = torch.cat([micro[LOW_MASK_KEY].flatten() for micro in trainer._buffered_inputs])
        assert 0 < int(every_low.sum()) < int(sum(int(m["completion_mask"].sum()) for m in trainer._buffered_inputs))
        assert low.dtype == torch.bool
    if setting.startswith("clipping"):
        assert 0 < clipped_share < 1, "clipping holds on some sequences of a micro-step, not on all"
    if args.advantage_reweighting_enabled:
        assert AR_WEIGHTS_KEY in trainer._buffered_inputs[0]
    logged = [entry for entry in trainer.state.log_history if "lopti/low_token_share" in entry]
    assert len(logged) == 1, "the split is logged once per generation batch"
    if args.lopti_enabled:  # at the generation's parameters (pi_old), on a micro-batch as buffered: low + high = plain
        with torch.no_grad():
            for name, parameter in trainer.model.named_parameters():
                parameter.copy_(initial[name])
        micro = trainer._buffered_inputs[0]
        _, plain = loss_and_gradients(trainer, micro, None)
        passes = [loss_and_gradients(trainer, micro, token_group)[1] for token_group in ("low", "high")]
        summed = {name: passes[0][name] + passes[1][name] for name in plain}
        difference = assert_gradients_close(summed, plain)
        print(f"RLOO cycle [{setting}]: largest |low + high - plain| gradient {difference:.3g}")  # noqa: T201


def test_with_both_methods_off_it_is_rloo_trainer(tiny_float64_model_path, tmp_path, float64_norms):
    """Same generations, loss, gradients and parameters as TRL's RLOOTrainer over two generation batches."""
    runs = {}
    for name, trainer_class, config_class, extra in (
        ("rloo", RLOOTrainer, RLOOConfig, {}),
        ("lopti", LoptiRLOOTrainer, LoptiRLOOConfig, dict(advantage_reweighting_alpha=0.0, lopti_threshold=None)),
    ):
        config = rloo_config(
            config_class,
            tmp_path / name,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            steps_per_generation=2,
            max_steps=2,
            learning_rate=0.1,
            seed=5,
            **extra,
        )
        trainer = trainer_class(
            model=tiny_float64_model_path,
            reward_funcs=token_parity_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(8)]}),
        )
        use_exact_log_prob_head(trainer)
        initial = copy.deepcopy(dict(trainer.model.named_parameters()))
        trainer.train()
        runs[name] = trainer, initial
    (rloo, initial), (lopti, _) = runs["rloo"], runs["lopti"]
    difference, moved = assert_parameters_close(
        dict(lopti.model.named_parameters()), dict(rloo.model.named_parameters()), initial, atol=1e-12
    )
    assert difference == 0.0 and moved > 0
    losses = [[entry["loss"] for entry in t.state.log_history if "loss" in entry] for t in (rloo, lopti)]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_a_plain_rloo_config_is_upgraded_with_a_visible_warning(tiny_model_path, tmp_path):
    plain = RLOOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, learning_rate=3e-6, max_steps=7)
    with pytest.warns(UserWarning, match=r"LoptiRLOOTrainer got a plain RLOOConfig") as caught:
        trainer = LoptiRLOOTrainer(
            model=tiny_model_path,
            reward_funcs=constant_reward,
            args=plain,
            train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}),
        )
    message = str(caught[0].message)
    assert all(text in message for text in ("advantage_reweighting_alpha=0.3", "lopti_threshold=0.5", "max_steps"))
    assert isinstance(trainer.args, LoptiRLOOConfig) and (trainer.args.learning_rate, trainer.args.max_steps) == (
        3e-6,
        7,
    )
    assert trainer._name.startswith("RLOO with Advantage Reweighting (alpha=0.3) and Low-Probability")


def test_the_config_validates_as_grpos_and_refuses_grpos_estimators():
    def make(**fields):
        return LoptiRLOOConfig(output_dir="unused", report_to="none", use_cpu=True, **fields)

    config = make()
    assert isinstance(config, RLOOConfig) and config.beta == 0.05, "RLOO's own defaults stay"
    assert (config.advantage_reweighting_alpha, config.lopti_threshold, config.lopti_order) == (0.3, 0.5, "low_first")
    for field, value, allowed in (
        ("advantage_reweighting_alpha", 1.5, "[0, 1]"),
        ("lopti_threshold", 0.0, "(0, 1)"),
        ("lopti_quantile", 1.0, "(0, 1)"),
    ):
        with pytest.raises(ValueError, match=rf"{field} must be a number in {re_escape(allowed)}.*{value!r}"):
            make(**{field: value})
    with pytest.raises(TypeError, match=r"advantage_estimator"):  # REINFORCE++ is LoptiGRPOConfig's
        make(advantage_estimator="reinforce_plus_plus")
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \(4\).*steps_per_generation=4"):
        make(gradient_accumulation_steps=4, steps_per_generation=2)
    assert make(lopti_quantile=0.3).lopti_threshold is None


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_reward_funcs_is_required_where_trls_trainer_requires_it():
    """The signature a user reads (and the API page shows) says what TRL's says: RLOOTrainer requires its reward
    functions, GRPOTrainer's default to None."""
    import inspect

    from trl import GRPOTrainer, RLOOTrainer

    from trl_lopti import LoptiGRPOTrainer, LoptiRLOOTrainer

    for lopti_class, trl_class in ((LoptiRLOOTrainer, RLOOTrainer), (LoptiGRPOTrainer, GRPOTrainer)):
        lopti_default = inspect.signature(lopti_class.__init__).parameters["reward_funcs"].default
        trl_default = inspect.signature(trl_class.__init__).parameters["reward_funcs"].default
        assert lopti_default == trl_default, (lopti_class.__name__, lopti_default, trl_default)
    with pytest.raises(TypeError, match="reward_funcs"):
        LoptiRLOOTrainer("a-model")
