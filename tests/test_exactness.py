"""Exactness of AR and Lopti at equal parameters, against an independent GRPO loss (tests/reference_grpo.py).

Lopti's isolation in its general form: in a pass, the gradient w.r.t. every inactive token's log-probability and
entropy is exactly zero, the active tokens' gradients are those of plain GRPO, and low + high == plain, for every loss
type and both importance-sampling levels.
"""

import copy
import math

import pytest
import torch
from datasets import Dataset
from reference_grpo import completion_logps_and_entropies, reference_grpo_loss
from testing_utils import FLOAT64, in_pass, threshold_between_values, use_exact_log_prob_head
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer
from trl_lopti.lopti_mixin import ETA_KEY


TEMPERATURE = 0.7
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
MAX_COMPLETION_LENGTH = 7
ALL_LOSS_TYPES = ["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]
REFERENCE_LOSS_TYPES = ["dapo", "grpo", "bnpo", "dr_grpo"]
# float64 model and log-prob head: the trainer and the independent loss agree to ~1e-15 (AR weights: testing_utils)
GRADIENT_ATOL, GRADIENT_RTOL = 1e-10, 1e-8


def constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def move_away_from_the_reference(model) -> None:
    """Perturbs the policy's parameters (seeded) so that the KL term has a gradient."""
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))


@pytest.fixture(scope="module")
def models(tiny_float64_model_path):
    """The float64 policy every trainer of this module starts from, and the reference model (the batches' makers)."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_float64_model_path, dtype=torch.float64)
    policy = copy.deepcopy(reference)
    move_away_from_the_reference(policy)
    return policy, reference


@pytest.fixture
def build(tiny_float64_model_path, tmp_path, float64_norms):
    """
    `build(**fields)`: a new float64 trainer configured by `LoptiGRPOConfig` fields (the loss type, beta, AR and Lopti
    settings, TRL options), its policy the `models` fixture's, TRL's log-prob head exact (testing_utils).
    """

    def build(**fields) -> LoptiGRPOTrainer:
        config = LoptiGRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=MAX_COMPLETION_LENGTH,
            temperature=TEMPERATURE,
            epsilon=EPSILON_LOW,
            epsilon_high=EPSILON_HIGH,
            report_to="none",
            use_cpu=True,
            **FLOAT64,
            **fields,
        )
        dataset = Dataset.from_dict({"prompt": ["a"] * 4})
        trainer = LoptiGRPOTrainer(
            model=tiny_float64_model_path, reward_funcs=constant_reward, args=config, train_dataset=dataset
        )
        use_exact_log_prob_head(trainer)
        move_away_from_the_reference(trainer.model)
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        assert trainer.model.dtype == torch.float64
        return trainer

    return build


def make_batch(models, seed: int, old_logps_noise: float = 0.3) -> dict:
    """A generation micro-batch as TRL hands it to compute_loss, with off-policy pi_old so that ratios clip, for the
    policy and reference model `models`."""
    policy, reference = models
    generator = torch.Generator().manual_seed(seed)
    vocab_size = policy.config.vocab_size
    batch_size, prompt_length = 4, 5
    completion_ids = torch.randint(3, vocab_size, (batch_size, MAX_COMPLETION_LENGTH), generator=generator)
    completion_mask = torch.ones(batch_size, MAX_COMPLETION_LENGTH, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    inputs = {
        "prompt_ids": torch.randint(3, vocab_size, (batch_size, prompt_length), generator=generator),
        "prompt_mask": torch.ones(batch_size, prompt_length, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch_size, generator=generator),
        "num_items_in_batch": completion_mask.sum(),
    }
    with torch.no_grad():
        current_logps, _ = completion_logps_and_entropies(policy, inputs, TEMPERATURE)
        inputs["old_per_token_logps"] = current_logps + old_logps_noise * torch.randn(
            current_logps.shape, generator=generator
        )
        inputs["ref_per_token_logps"], _ = completion_logps_and_entropies(reference, inputs, TEMPERATURE)
    return inputs


def splitting_eta(inputs: dict) -> float:
    """A threshold that puts about half the completion tokens in each group, far from every token's pi_old."""
    return threshold_between_values(inputs["old_per_token_logps"].exp()[inputs["completion_mask"].bool()])


def settings(loss_type: str, beta: float, alpha: float, eta: float | None = 0.5, entropy_coef: float = 0.0) -> dict:
    """The `LoptiGRPOConfig` fields the tests vary."""
    return dict(
        loss_type=loss_type,
        beta=beta,
        entropy_coef=entropy_coef,
        advantage_reweighting_alpha=alpha,
        lopti_threshold=eta,
    )


def trainer_loss_and_gradients(trainer, inputs: dict, token_group: str | None):
    trainer.model.zero_grad(set_to_none=True)
    with in_pass(trainer, token_group):
        loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    gradients = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


def reference_loss_and_gradients(trainer, inputs: dict, alpha: float, token_group: str | None, eta: float = 0.5):
    trainer.model.zero_grad(set_to_none=True)
    logps, entropies = completion_logps_and_entropies(trainer.model, inputs, TEMPERATURE)
    old_logps, mask = inputs["old_per_token_logps"], inputs["completion_mask"].float()
    old_probs = old_logps.exp()
    token_advantages = inputs["advantages"][:, None] * (alpha * old_probs + 1 - alpha)
    active = torch.ones_like(mask)
    if token_group is not None:
        low = (old_probs < eta).float() * mask
        active = low if token_group == "low" else mask * (1 - low)
    loss = reference_grpo_loss(
        logps,
        entropies,
        old_logps,
        token_advantages * active,
        mask,
        loss_type=trainer.loss_type,
        epsilon_low=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        beta=trainer.beta,
        ref_logps=inputs["ref_per_token_logps"],
        kl_mask=active,
        entropy_coef=trainer.entropy_coef,
        entropy_grad_mask=active,
        num_items_in_batch=inputs["num_items_in_batch"],
        max_completion_length=MAX_COMPLETION_LENGTH,
        importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
    )
    loss.backward()
    gradients = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


def assert_gradients_close(actual: dict, expected: dict, relative_to_largest: float = 0.0):
    """Equal to GRADIENT_ATOL/RTOL, plus `relative_to_largest` of each tensor's largest entry (float32 tests only)."""
    assert actual.keys() == expected.keys()
    total_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in expected.values()))
    assert total_norm > 0, "degenerate case: the expected gradient is zero"
    for name, gradient in expected.items():
        atol = GRADIENT_ATOL + relative_to_largest * float(gradient.abs().max())
        rtol = max(GRADIENT_RTOL, relative_to_largest)
        torch.testing.assert_close(
            actual[name], gradient, atol=atol, rtol=rtol, msg=lambda message, name=name: f"{name}: {message}"
        )


@pytest.mark.parametrize("loss_type", REFERENCE_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_advantage_reweighting_matches_independent_grpo(build, models, loss_type, beta, alpha):
    trainer = build(**settings(loss_type, beta, alpha, eta=None))
    inputs = make_batch(models, seed=11)
    loss, gradients = trainer_loss_and_gradients(trainer, inputs, token_group=None)
    expected_loss, expected_gradients = reference_loss_and_gradients(trainer, inputs, alpha, token_group=None)
    torch.testing.assert_close(loss, expected_loss, atol=GRADIENT_ATOL, rtol=GRADIENT_RTOL)
    assert_gradients_close(gradients, expected_gradients)


def test_advantage_reweighting_changes_the_gradient(build, models):
    """Guards the test above against a reference that ignores alpha: alpha 0.3 and 0 must differ."""
    inputs = make_batch(models, seed=11)
    _, reweighted = trainer_loss_and_gradients(build(**settings("dapo", 0.0, 0.3, eta=None)), inputs, None)
    _, plain = trainer_loss_and_gradients(build(**settings("dapo", 0.0, 0.0, eta=None)), inputs, None)
    difference = sum(float((reweighted[n] - plain[n]).abs().sum()) for n in plain)
    assert difference > 1e-4


@pytest.mark.parametrize("loss_type", REFERENCE_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("token_group", ["low", "high"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_lopti_pass_matches_independent_grpo(build, models, loss_type, beta, token_group, entropy_coef):
    inputs = make_batch(models, seed=5)
    eta = splitting_eta(inputs)
    trainer = build(**settings(loss_type, beta, alpha=0.3, eta=eta, entropy_coef=entropy_coef))
    _, gradients = trainer_loss_and_gradients(trainer, inputs, token_group)
    _, expected_gradients = reference_loss_and_gradients(trainer, inputs, 0.3, token_group, eta=eta)
    assert_gradients_close(gradients, expected_gradients)


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
def test_low_pass_plus_high_pass_equals_plain_gradient(
    build, models, loss_type, beta, entropy_coef, importance_sampling_level
):
    if loss_type == "vespo" and importance_sampling_level == "sequence":
        pytest.skip("VESPO is sequence-level by construction")
    inputs = make_batch(models, seed=7)
    eta = splitting_eta(inputs)
    alpha = 0.0 if importance_sampling_level == "sequence" and beta else 0.3  # AR refuses a KL with a shared ratio
    fields = settings(loss_type, beta, alpha=alpha, eta=eta, entropy_coef=entropy_coef)
    trainer = build(**fields, importance_sampling_level=importance_sampling_level)
    low_mask = (inputs["old_per_token_logps"].exp() < eta) & inputs["completion_mask"].bool()
    assert 0 < int(low_mask.sum()) < int(inputs["completion_mask"].sum()), "both groups must be non-empty"
    _, low = trainer_loss_and_gradients(trainer, inputs, "low")
    _, high = trainer_loss_and_gradients(trainer, inputs, "high")
    _, plain = trainer_loss_and_gradients(trainer, inputs, None)
    assert_gradients_close({n: low[n] + high[n] for n in plain}, plain)
    # each pass is a genuine part of the whole, not all of it
    assert any(not torch.allclose(low[n], plain[n]) for n in plain)


def test_split_uses_pi_old_not_current_probability(build, models):
    """pi_old and the current policy disagree on the split; the pass must follow pi_old."""
    trainer = build(**settings("dapo", 0.1, alpha=0.3, eta=0.5))
    inputs = make_batch(models, seed=3, old_logps_noise=0.0)
    mask = inputs["completion_mask"].bool()
    # flip the group of every token: pi_old := 1 - pi (kept in (0, 1))
    current_probs = inputs["old_per_token_logps"].exp()
    inputs["old_per_token_logps"] = torch.log((1 - current_probs).clamp(1e-4, 1 - 1e-4))
    split_by_old = (inputs["old_per_token_logps"].exp() < 0.5) & mask
    split_by_current = (current_probs < 0.5) & mask
    assert not torch.equal(split_by_old, split_by_current)
    # by pi_old every token is high (active in the high pass); by the current policy every token would be low
    assert split_by_current.sum() == mask.sum() and split_by_old.sum() == 0
    _, gradients = trainer_loss_and_gradients(trainer, inputs, "high")
    _, expected = reference_loss_and_gradients(trainer, inputs, 0.3, "high", eta=0.5)
    assert_gradients_close(gradients, expected)


def use_vllm_importance_sampling(trainer, inputs: dict, sampling_per_token_logps: torch.Tensor, generator) -> None:
    """What TRL's loss reads under vLLM with its importance-sampling correction: two attributes it sets at construction
    from `use_vllm` (which needs a vLLM server there), and the batch's sampler log-probabilities and ratios."""
    inputs["sampling_per_token_logps"] = sampling_per_token_logps
    inputs["importance_sampling_ratio"] = 0.5 + torch.rand(inputs["completion_mask"].shape, generator=generator)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True


def test_vllm_fields_use_trainer_pi_old_and_keep_the_correction(build, models):
    """With vLLM, AR and the split read `old_per_token_logps`, and TRL's importance-sampling correction applies."""
    inputs = make_batch(models, seed=9)
    eta = splitting_eta(inputs)
    trainer = build(**settings("dapo", 0.1, alpha=0.3, eta=eta))
    # the sampler's log-probs differ from pi_old enough to move tokens across eta if they were (wrongly) used
    generator = torch.Generator().manual_seed(0)
    use_vllm_importance_sampling(trainer, inputs, inputs["old_per_token_logps"].flip(-1), generator)
    for token_group in ["low", "high", None]:
        _, gradients = trainer_loss_and_gradients(trainer, inputs, token_group)
        _, expected = reference_loss_and_gradients(trainer, inputs, 0.3, token_group, eta=eta)
        assert_gradients_close(gradients, expected)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_degenerate_micro_batches_give_finite_zero_gradients(build, models, loss_type):
    """All-equal rewards (zero advantages), empty completions, and a pass with no active token: no NaN."""
    trainer = build(**settings(loss_type, 0.0, alpha=0.3, eta=0.5, entropy_coef=0.0))
    inputs = make_batch(models, seed=2)
    inputs["advantages"] = torch.zeros(4)
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    for token_group in ["low", "high", None]:
        trainer.model.zero_grad(set_to_none=True)
        with in_pass(trainer, token_group):
            loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()
        assert torch.isfinite(loss)
        for parameter in trainer.model.parameters():
            assert parameter.grad is None or torch.isfinite(parameter.grad).all()


# ---------------------------------------------------------------------------------------------- general isolation
TRL_OPTIONS = {  # GRPOConfig fields; "vllm": TRL's vLLM importance-sampling correction
    "plain": {},
    "top_entropy_quantile": {"top_entropy_quantile": 0.5},
    "delta": {"delta": 1.05},
    "off_policy_mask": {"off_policy_mask_threshold": 0.05},
    "vllm_is_correction": {"vllm": True},
}


class PolicyOutputs:
    """Keeps the log-probabilities and entropies TRL's policy forward returns, with their gradients."""

    def __init__(self, monkeypatch):
        self.logps = self.entropies = None
        original = GRPOTrainer._get_per_token_logps_and_entropies

        def capture(trainer_self, *args, **kwargs):
            logps, entropies, aux_loss = original(trainer_self, *args, **kwargs)
            if logps.requires_grad:
                logps.retain_grad()
                if entropies is not None and entropies.requires_grad:  # TRL < 1.11 computes them without gradient
                    entropies.retain_grad()
                self.logps, self.entropies = logps, entropies
            return logps, entropies, aux_loss

        monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", capture)

    def gradients(self, trainer, inputs: dict, token_group: str | None):
        loss, _ = trainer_loss_and_gradients(trainer, inputs, token_group)
        entropy_grad = (
            torch.zeros_like(self.logps)
            if self.entropies is None or self.entropies.grad is None
            else (self.entropies.grad.clone())
        )
        return loss, self.logps.grad.clone(), entropy_grad


def lopti_groups(inputs: dict, eta: float):
    mask = inputs["completion_mask"].bool()
    low = (inputs["old_per_token_logps"].exp() < eta) & mask
    return {"low": low, "high": mask & ~low}


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("option", list(TRL_OPTIONS))
def test_inactive_tokens_get_exactly_zero_gradient_and_active_ones_plain_grpos(
    build, models, monkeypatch, loss_type, importance_sampling_level, option
):
    if loss_type == "vespo" and importance_sampling_level == "sequence":
        pytest.skip("VESPO is sequence-level by construction")
    outputs = PolicyOutputs(monkeypatch)
    inputs = make_batch(models, seed=7)
    eta = splitting_eta(inputs)
    options = dict(TRL_OPTIONS[option])
    vllm = options.pop("vllm", False)
    beta = 0.1 if importance_sampling_level == "token" else 0.0  # AR refuses a KL with a shared ratio
    fields = settings(loss_type, beta=beta, alpha=0.3, eta=eta, entropy_coef=0.05)
    trainer = build(**fields, importance_sampling_level=importance_sampling_level, **options)
    if vllm:
        generator = torch.Generator().manual_seed(4)
        noise = 0.2 * torch.randn(inputs["old_per_token_logps"].shape, generator=generator)
        use_vllm_importance_sampling(trainer, inputs, inputs["old_per_token_logps"] + noise, generator)
    plain_loss, plain_logp_grad, plain_entropy_grad = outputs.gradients(trainer, inputs, None)
    groups = lopti_groups(inputs, eta)
    summed = torch.zeros_like(plain_logp_grad)
    for token_group, active in groups.items():
        loss, logp_grad, entropy_grad = outputs.gradients(trainer, inputs, token_group)
        inactive = ~active
        assert torch.count_nonzero(logp_grad[inactive]) == 0, f"{token_group} pass leaks to inactive tokens"
        assert torch.count_nonzero(entropy_grad[inactive]) == 0
        tolerance = dict(atol=GRADIENT_ATOL, rtol=GRADIENT_RTOL)
        torch.testing.assert_close(logp_grad[active], plain_logp_grad[active], **tolerance)
        torch.testing.assert_close(entropy_grad[active], plain_entropy_grad[active], **tolerance)
        torch.testing.assert_close(loss, plain_loss)  # every value in the loss is plain GRPO's
        summed += logp_grad
    torch.testing.assert_close(summed, plain_logp_grad, atol=GRADIENT_ATOL, rtol=GRADIENT_RTOL)
    assert plain_logp_grad[groups["low"]].abs().sum() > 0 and plain_logp_grad[groups["high"]].abs().sum() > 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "luspo"])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("token_group", ["low", "high"])
def test_lopti_pass_matches_the_independent_general_form(
    build, models, loss_type, importance_sampling_level, token_group
):
    """Parameter gradients of each pass against the reference loss with gradient only through active tokens, AR as
    token-level advantages (a token's own ratio) or through each token's log-probability (a sequence's shared one)."""
    inputs = make_batch(models, seed=13)
    eta = splitting_eta(inputs)
    beta = 0.1 if importance_sampling_level == "token" else 0.0  # AR refuses a KL with a shared ratio
    fields = settings(loss_type, beta=beta, alpha=0.3, eta=eta, entropy_coef=0.05)
    trainer = build(**fields, importance_sampling_level=importance_sampling_level)
    _, gradients = trainer_loss_and_gradients(trainer, inputs, token_group)
    trainer.model.zero_grad(set_to_none=True)
    logps, entropies = completion_logps_and_entropies(trainer.model, inputs, TEMPERATURE)
    old_logps = inputs["old_per_token_logps"]
    weights = 0.3 * old_logps.exp() + 0.7
    token_level = importance_sampling_level == "token"
    reference = reference_grpo_loss(
        logps,
        entropies,
        old_logps,
        inputs["advantages"][:, None] * (weights if token_level else torch.ones_like(weights)),
        inputs["completion_mask"],
        loss_type=loss_type,
        epsilon_low=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        beta=beta,
        ref_logps=inputs["ref_per_token_logps"],
        entropy_coef=0.05,
        num_items_in_batch=inputs["num_items_in_batch"],
        max_completion_length=MAX_COMPLETION_LENGTH,
        importance_sampling_level=importance_sampling_level,
        grad_mask=lopti_groups(inputs, eta)[token_group],
        gradient_weights=None if token_level else weights,
    )
    reference.backward()
    expected = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    assert_gradients_close(gradients, expected)


@pytest.fixture(scope="module")
def moe_model_path(tmp_path_factory) -> str:
    """A tiny random Qwen2-MoE with router logits (TRL then adds the router's auxiliary loss)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from trl_lopti.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-moe")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_router_auxiliary_loss_is_trained_once_per_cycle(moe_model_path, tmp_path):
    """MoE: low + high == plain holds with TRL's router auxiliary loss (its gradient comes in the first pass only)."""
    config = LoptiGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        report_to="none",
        use_cpu=True,
        bf16=False,
        advantage_reweighting_alpha=0.3,
        beta=0.1,
    )
    moe = LoptiGRPOTrainer(
        model=moe_model_path,
        reward_funcs=constant_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}),
    )
    assert moe.aux_loss_enabled
    moe.current_gradient_accumulation_steps = 1
    moe.model.train()
    inputs = make_batch((moe.model, moe.ref_model), seed=7)
    inputs[ETA_KEY] = torch.tensor(splitting_eta(inputs), dtype=torch.float64)  # the generation batch's eta
    _, plain = trainer_loss_and_gradients(moe, inputs, None)
    _, low = trainer_loss_and_gradients(moe, inputs, "low")  # the first pass
    _, high = trainer_loss_and_gradients(moe, inputs, "high")  # the second pass
    router = [n for n in plain if ".gate.weight" in n and "shared" not in n]
    assert router and all(plain[n].abs().sum() > 0 for n in router)
    summed = {n: low.get(n, torch.zeros_like(plain[n])) + high.get(n, torch.zeros_like(plain[n])) for n in plain}
    # the real float32 path (TRL's fused head): two backward passes round apart by ~1e-7 of each tensor's scale
    assert_gradients_close(summed, plain, relative_to_largest=1e-5)


# ---------------------------------------------------------------------------------------------- AR under every loss
CLIPPING_LOSS_TYPES = ["dapo", "grpo", "bnpo", "dr_grpo", "luspo"]  # a clipped token (or sequence) gets no gradient


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
def test_advantage_reweighting_scales_each_tokens_gradient_by_its_weight(
    build, models, monkeypatch, loss_type, importance_sampling_level
):
    """Through TRL's own loss (autograd on the log-probabilities its forward returns), at equal parameters and with
    clipping active: the gradient through each completion token's log-probability under AR is `w(t)` times plain
    GRPO's, for every loss type at both levels. Token-level advantages `w * A` would give a shared ratio the mean `w`
    of its sequence; the test measures that too, and fails for it wherever the ratio is shared and differentiated."""
    outputs = PolicyOutputs(monkeypatch)
    inputs = make_batch(models, seed=17)
    # two sequences whose ratios lie outside the clip range on the side their advantages clip: ratio e^-0.5 with a
    # negative advantage, e^0.5 with a positive one (the other two sequences keep ratios near 1)
    inputs["old_per_token_logps"][0] += 0.5
    inputs["old_per_token_logps"][2] -= 0.5
    inputs["advantages"][0], inputs["advantages"][2] = -inputs["advantages"][0].abs(), inputs["advantages"][2].abs()
    mask = inputs["completion_mask"].bool()
    weights = 0.3 * inputs["old_per_token_logps"].exp() + 0.7
    level = dict(importance_sampling_level=importance_sampling_level)
    _, plain, _ = outputs.gradients(build(**settings(loss_type, 0.0, alpha=0.0, eta=None), **level), inputs, None)
    _, reweighted, _ = outputs.gradients(build(**settings(loss_type, 0.0, alpha=0.3, eta=None), **level), inputs, None)
    token_advantages = dict(inputs, advantages=inputs["advantages"][:, None] * weights)
    plain_trainer = build(**settings(loss_type, 0.0, alpha=0.0, eta=None), **level)
    _, token_form, _ = outputs.gradients(plain_trainer, token_advantages, None)
    flowing = mask & (plain != 0)
    if loss_type in CLIPPING_LOSS_TYPES:
        assert 0 < int(flowing.sum()) < int(mask.sum()), "clipping must be active on some tokens or sequences"
    assert torch.count_nonzero(reweighted[~flowing]) == 0
    ratio = reweighted[flowing] / plain[flowing]
    torch.testing.assert_close(ratio, weights[flowing], atol=1e-12, rtol=1e-10)
    token_form_error = float((token_form[flowing] / plain[flowing] - weights[flowing]).abs().max())
    print(  # noqa: T201 - the measured figures, for the record (pytest -s)
        f"{loss_type}/{importance_sampling_level}: max |AR/plain - w| {float((ratio - weights[flowing]).abs().max()):.2g}"
        f", token-level advantages {token_form_error:.2g}"
    )
    ratio_is_shared_and_differentiated = importance_sampling_level == "sequence" and loss_type not in (
        "cispo",
        "vespo",
    )
    if ratio_is_shared_and_differentiated:
        assert token_form_error > 1e-6, "token-level advantages would give a shared ratio its sequence's mean weight"
    else:
        assert token_form_error < 1e-9


def test_advantage_reweighting_leaves_the_kl_gradient_alone(build, models, monkeypatch):
    """With a token's own ratio and beta > 0: AR's gradient minus its beta = 0 gradient (the KL term's part) is plain
    GRPO's KL part, per token; with a shared ratio the combination is refused at config time."""
    outputs = PolicyOutputs(monkeypatch)
    inputs = make_batch(models, seed=19)
    kl_parts = []
    for alpha in (0.0, 0.3):
        _, with_kl, _ = outputs.gradients(build(**settings("dapo", 0.1, alpha=alpha, eta=None)), inputs, None)
        _, without_kl, _ = outputs.gradients(build(**settings("dapo", 0.0, alpha=alpha, eta=None)), inputs, None)
        kl_parts.append(with_kl - without_kl)
    assert kl_parts[0].abs().sum() > 0
    torch.testing.assert_close(kl_parts[1], kl_parts[0], atol=1e-12, rtol=1e-9)
    with pytest.raises(ValueError, match="advantage_reweighting_alpha=0.3 with importance_sampling_level='sequence'"):
        settings_fields = settings("dapo", 0.1, alpha=0.3, eta=None)
        LoptiGRPOConfig(output_dir="unused", use_cpu=True, importance_sampling_level="sequence", **settings_fields)
