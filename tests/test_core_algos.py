"""The pure AR/Lopti functions, each against an independent computation."""

import numpy as np
import pytest
import torch

from trl_lopti.core_algos import (
    advantage_reweighting_weights,
    isolate_advantages,
    lopti_active_token_mask,
    low_probability_token_mask,
    neutralize_inactive_kl,
    reweight_advantages,
    stop_gradient_where_inactive,
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
    low = lopti_active_token_mask(logps, mask, 0.5, "low")
    high = lopti_active_token_mask(logps, mask, 0.5, "high")
    assert not (low & high).any()
    assert torch.equal(low | high, mask.bool())
    probs = logps.exp().numpy()
    np.testing.assert_array_equal(low.numpy(), (probs < 0.5) & mask.numpy().astype(bool))


def test_threshold_is_strict_and_in_log_space():
    logps = torch.log(torch.tensor([[0.3, 0.5, 0.7]]))
    low = low_probability_token_mask(logps, torch.ones(1, 3), 0.5)
    assert low.tolist() == [[True, False, False]]


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_threshold_out_of_range_is_rejected(batch, bad):
    logps, mask, _ = batch
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        low_probability_token_mask(logps, mask, bad)


def test_unknown_token_group_is_rejected(batch):
    logps, mask, _ = batch
    with pytest.raises(ValueError, match="token_group"):
        lopti_active_token_mask(logps, mask, 0.5, "middle")


def test_isolated_advantages_are_zero_exactly_where_inactive(batch):
    logps, mask, advantages = batch
    active = lopti_active_token_mask(logps, mask, 0.5, "low")
    isolated = isolate_advantages(advantages, active)
    expected = np.where(active.numpy(), advantages.numpy()[:, None], 0.0)
    np.testing.assert_array_equal(isolated.numpy(), expected)


def test_stop_gradient_keeps_values_and_gradient_of_active_tokens_only():
    values = torch.randn(2, 3, requires_grad=True)
    active = torch.tensor([[True, False, True], [False, False, True]])
    out = stop_gradient_where_inactive(values, active)
    assert torch.equal(out.detach(), values.detach())
    out.sum().backward()
    assert torch.equal(values.grad, active.float())


def test_neutralized_kl_is_zero_in_value_and_gradient_for_inactive_tokens():
    logps = torch.log(torch.tensor([[0.2, 0.6, 0.9]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.5, 0.1, 0.3]]))
    active = torch.tensor([[True, False, False]])
    ratio = torch.exp(logps - logps.detach() + 0.1)  # a differentiable importance ratio, as with bias correction
    neutral_ref = neutralize_inactive_kl(ref, logps, active)
    kl = (torch.exp(neutral_ref - logps) - (neutral_ref - logps) - 1) * ratio
    kl.sum().backward()
    assert kl[0, 1].item() == 0.0 and kl[0, 2].item() == 0.0
    assert logps.grad[0, 1].item() == 0.0 and logps.grad[0, 2].item() == 0.0
    # the active token keeps the k3 gradient: d/dlogp [(e^d - d - 1) r] with d = ref - logp and dr/dlogp = r
    d = (ref[0, 0] - logps[0, 0]).item()
    r = ratio[0, 0].item()
    expected = (1 - np.exp(d)) * r + (np.exp(d) - d - 1) * r
    assert logps.grad[0, 0].item() == pytest.approx(expected, rel=1e-5)
