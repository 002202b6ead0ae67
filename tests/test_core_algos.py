"""The pure AR/Lopti functions, each against an independent computation."""

import math

import numpy as np
import pytest
import torch

from trl_lopti.core_algos import (
    advantage_reweighting_weights,
    isolate_token_gradients,
    low_probability_token_mask,
    reinforce_plus_plus_advantages,
    reweight_advantages,
    reweight_token_gradients,
    token_group_mask,
    token_level_advantages,
)


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 5, generator=generator).clamp(0.01, 0.99)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    advantages = torch.tensor([1.5, -0.5, 2.0])
    return probs.log(), mask, advantages


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.3, 1.0])
def test_reweighted_advantages_follow_the_paper_formula(batch, alpha):
    logps, _, advantages = batch
    expected = (alpha * np.exp(logps.numpy()) + (1 - alpha)) * advantages.numpy()[:, None]
    np.testing.assert_allclose(reweight_advantages(advantages, logps, alpha).numpy(), expected, rtol=1e-6)


def test_alpha_zero_is_the_identity_and_weights_are_bounded(batch):
    logps, _, advantages = batch
    assert torch.equal(reweight_advantages(advantages, logps, 0.0), advantages[:, None].expand(-1, 5))
    weights = advantage_reweighting_weights(logps, 0.3)
    assert (weights >= 0.7).all() and (weights <= 1.0).all()


def test_weights_carry_no_gradient(batch):
    logps, _, advantages = batch
    logps = logps.clone().requires_grad_(True)
    assert not reweight_advantages(advantages, logps, 0.3).requires_grad


def test_token_level_advantages_pass_through_and_reject_bad_shapes():
    token_advantages = torch.randn(2, 4)
    assert token_level_advantages(token_advantages, 4) is token_advantages
    with pytest.raises(ValueError, match="advantages must have shape"):
        token_level_advantages(torch.randn(2, 3), 4)


def test_low_and_high_partition_the_completion_tokens(batch):
    logps, mask, _ = batch
    split = low_probability_token_mask(logps, mask, 0.5)
    low, high = (token_group_mask(split, mask, group) for group in ("low", "high"))
    assert not (low & high).any()
    assert torch.equal(low | high, mask.bool())
    probs = logps.exp().numpy()
    np.testing.assert_array_equal(low.numpy(), (probs < 0.5) & mask.numpy().astype(bool))


def test_threshold_is_strict_in_probability_space():
    # a log-prob x whose probability rounds so that log(exp(x)) > x: a comparison in log space would call it low
    candidates = -torch.linspace(0.01, 3.0, 3000)
    x = next(float(v) for v in candidates if float(v) < math.log(float(torch.exp(v))))
    logps = torch.tensor([[x, x - 1.0, x, x + 0.5, x]])
    eta = float(torch.exp(logps)[0, 0])  # the token's own probability, as the mask computes it
    assert low_probability_token_mask(logps, torch.ones(1, 5), eta).tolist() == [[False, True, False, False, False]]
    low = low_probability_token_mask(
        torch.log(torch.tensor([[0.3, 0.5, 0.7]], dtype=torch.float64)), torch.ones(1, 3), 0.5
    )
    assert low.tolist() == [[True, False, False]]


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_threshold_out_of_range_is_rejected(batch, bad):
    logps, mask, _ = batch
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        low_probability_token_mask(logps, mask, bad)


def test_unknown_token_group_is_rejected(batch):
    logps, mask, _ = batch
    with pytest.raises(ValueError, match="token_group"):
        token_group_mask(low_probability_token_mask(logps, mask, 0.5), mask, "middle")


def test_isolation_keeps_values_and_passes_gradient_through_active_tokens_only():
    values = torch.randn(2, 3, requires_grad=True)
    active = torch.tensor([[True, False, True], [False, False, True]])
    out = isolate_token_gradients(values, active)
    assert torch.equal(out.detach(), values.detach())
    upstream = torch.randn(2, 3)
    out.backward(upstream)
    assert torch.equal(values.grad, torch.where(active, upstream, torch.zeros_like(upstream)))


def test_isolation_cuts_the_leak_through_a_sequence_level_ratio():
    """A ratio shared by the whole sequence: zeroing advantages alone leaves gradient on inactive tokens."""
    logps = torch.log(torch.tensor([[0.2, 0.6, 0.9, 0.05]])).requires_grad_(True)
    old = logps.detach() - 0.1
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    active = torch.tensor([[True, False, False, True]])

    def sequence_loss(token_logps, token_advantages):
        sequence_ratio = torch.exp((token_logps - old).mean(-1, keepdim=True))
        return -(sequence_ratio * token_advantages).sum()

    sequence_loss(logps, torch.where(active, advantages, 0.0)).backward()
    assert (logps.grad[~active].abs() > 0).all(), "zeroing advantages alone leaks through the shared ratio"
    logps.grad = None
    sequence_loss(isolate_token_gradients(logps, active), advantages).backward()
    assert (logps.grad[~active] == 0).all() and (logps.grad[active].abs() > 0).all()


def reinforce_plus_plus_by_tokens(rewards, lengths):
    """Independent REINFORCE++: write every token's return out, whiten the token list, read one value per sequence."""
    token_returns = np.concatenate([np.full(length, reward) for reward, length in zip(rewards, lengths, strict=True)])
    mean, variance = token_returns.mean(), token_returns.var(ddof=1)
    return np.array(
        [
            (reward - mean) / np.sqrt(variance + 1e-8) if length else 0.0
            for reward, length in zip(rewards, lengths, strict=True)
        ]
    )


def sequence_ratio_loss(per_token_logps, old_per_token_logps, mask, advantages, epsilon=0.2):
    """RLOO's per-sequence clipped surrogate: one ratio per sequence from the summed token log-probabilities."""
    ratio = torch.exp(((per_token_logps - old_per_token_logps) * mask).sum(1))
    return -torch.min(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon) * advantages).mean()


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_gradient_reweighting_keeps_values_and_scales_each_tokens_gradient(batch, alpha):
    """AR's general form: the values are bitwise unchanged, d loss / d logp(t) is w(t) times the plain loss's."""
    logps, mask, advantages = batch
    generator = torch.Generator().manual_seed(3)
    old = logps + 0.05 * torch.randn(logps.shape, generator=generator)  # ratios near 1: no sequence clipped
    weights = advantage_reweighting_weights(old, alpha)
    plain_logps = logps.clone().requires_grad_(True)
    reweighted_logps = logps.clone().requires_grad_(True)
    values = reweight_token_gradients(reweighted_logps, weights)
    assert torch.equal(values, logps), "every value the loss reads is unchanged"
    plain = sequence_ratio_loss(plain_logps, old, mask, advantages)
    reweighted = sequence_ratio_loss(values, old, mask, advantages)
    assert torch.equal(plain, reweighted)
    plain.backward()
    reweighted.backward()
    # independent: d/d logp(t) of -mean_i(ratio_i * A_i) is -ratio_i * A_i * mask / B where unclipped
    ratio = torch.exp(((logps - old) * mask).sum(1))
    by_hand = -(ratio * advantages)[:, None] * mask / len(advantages)
    torch.testing.assert_close(plain_logps.grad, by_hand, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(reweighted_logps.grad, weights * plain_logps.grad, rtol=1e-6, atol=1e-7)
    if alpha > 0:
        assert not torch.allclose(reweighted_logps.grad, plain_logps.grad)


def test_gradient_reweighting_composes_with_isolation_in_either_order(batch):
    logps, mask, _ = batch
    weights = advantage_reweighting_weights(logps, 0.3)
    active = low_probability_token_mask(logps, mask, 0.5)
    gradients = []
    for order in ("reweight first", "isolate first"):
        values = logps.clone().requires_grad_(True)
        if order == "reweight first":
            out = isolate_token_gradients(reweight_token_gradients(values, weights), active)
        else:
            out = reweight_token_gradients(isolate_token_gradients(values, active), weights)
        assert torch.equal(out, logps)
        (out * torch.arange(1.0, 16.0).view(3, 5)).sum().backward()
        gradients.append(values.grad)
    expected = torch.where(active, weights * torch.arange(1.0, 16.0).view(3, 5), torch.zeros(3, 5))
    torch.testing.assert_close(gradients[0], expected)
    torch.testing.assert_close(gradients[1], expected)
    assert not weights.requires_grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_plus_plus_whitens_over_tokens_not_sequences(seed):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=12)
    lengths = rng.integers(0, 30, size=12)
    lengths[0] = 0  # an empty completion
    advantages = reinforce_plus_plus_advantages(torch.tensor(rewards), torch.tensor(lengths))
    expected = reinforce_plus_plus_by_tokens(rewards, lengths)
    np.testing.assert_allclose(advantages.numpy(), expected, rtol=1e-5, atol=1e-6)
    # token-weighted, not per sequence: the sequence-mean whitening gives other numbers
    per_sequence = (rewards - rewards[lengths > 0].mean()) / rewards[lengths > 0].std(ddof=1)
    assert not np.allclose(advantages.numpy()[lengths > 0], per_sequence[lengths > 0], atol=1e-3)
    # whitened: token-weighted mean 0 and unbiased token variance 1 (up to the 1e-8)
    token_advantages = np.repeat(advantages.numpy(), lengths)
    assert abs(token_advantages.mean()) < 1e-5 and token_advantages.var(ddof=1) == pytest.approx(1.0, rel=1e-4)


def test_reinforce_plus_plus_degenerate_batches_give_finite_advantages():
    equal = reinforce_plus_plus_advantages(torch.full((6,), 2.0), torch.tensor([3, 0, 5, 1, 2, 4]))
    assert torch.equal(equal, torch.zeros(6))
    single_token = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), torch.tensor([1, 0]))
    assert torch.equal(single_token, torch.zeros(2))
    nothing = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    assert torch.equal(nothing, torch.zeros(2))
    unscorable = reinforce_plus_plus_advantages(torch.tensor([1.0, float("nan"), 0.0]), torch.tensor([2, 3, 2]))
    assert torch.isfinite(unscorable).all() and unscorable[1] == 0
    np.testing.assert_allclose(
        unscorable.numpy()[[0, 2]], reinforce_plus_plus_by_tokens([1.0, 0.0], [2, 2]), rtol=1e-5
    )
    with pytest.raises(ValueError, match=r"shape \(N,\)"):
        reinforce_plus_plus_advantages(torch.zeros(2, 3), torch.ones(2, 3))
