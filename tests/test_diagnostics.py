"""Token-probability diagnostics (trl_lopti.diagnostics, `trl-lopti diagnose`) against closed forms and direct
computations, on batches built by hand and by TRL's own generation, scoring and advantages."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import threshold_between_values

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer
from trl_lopti.cli.diagnose import main as diagnose_main
from trl_lopti.diagnostics import (
    SUPPORTED_LOSS_TYPES,
    DiagnosticsSettings,
    TokenDiagnosticsCallback,
    advance_policy_on_batch,
    completion_log_probs,
    grpo_token_weights,
    hidden_state_gradient_norms,
    measure_token_gradients,
    probability_quartiles,
    probability_shift_probe,
    run_token_diagnostics,
    sample_generation_batch,
    unmodelled_loss_settings,
)


TEMPERATURE = 0.7


pytestmark = pytest.mark.usefixtures("single_thread")


class SoftmaxLM(torch.nn.Module):
    """A single softmax layer as a causal LM: the logits of position t are row `input_ids[t]` of a trainable table.

    The "last hidden state" is that row and the LM head is the frozen identity, so `d log pi / d h = (e_k - p) / T`.
    """

    def __init__(self, table: torch.Tensor):
        super().__init__()
        vocab_size = table.size(0)
        self.embed = torch.nn.Embedding(vocab_size, vocab_size)
        self.embed.weight.data.copy_(table)
        self.lm_head = torch.nn.Linear(vocab_size, vocab_size, bias=False)
        self.lm_head.weight.data.copy_(torch.eye(vocab_size))
        self.lm_head.weight.requires_grad_(False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, **kwargs):
        logits = self.lm_head(self.embed(input_ids))
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def numpy_softmax(x):
    z = x - x.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def reference_token_loss(logps, old_logps, advantages, ref_logps, beta, eps_low, eps_high, bias_correction):
    """TRL's per-token clipped-surrogate loss with the k3 KL term, written from the formulas."""
    ratio = torch.exp(logps - old_logps)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    delta = ref_logps - logps
    kl = torch.exp(delta) - delta - 1
    if bias_correction:
        kl = kl * ratio
    return loss + beta * kl


def softmax_batch(seed=0, vocab_size=16):
    """Four completions whose every token is predicted from a different row of the table (rows do not interact)."""
    generator = torch.Generator().manual_seed(seed)
    table = 2.0 * torch.randn(vocab_size, vocab_size, generator=generator)
    prompt_ids = torch.tensor([[0], [3], [6], [9]])
    completion_ids = torch.tensor([[1, 2, 13], [4, 5, 14], [7, 8, 15], [10, 11, 12]])
    completion_mask = torch.ones(4, 3, dtype=torch.long)
    completion_mask[3, 2] = 0
    for row, token in ((0, 1), (1, 2), (6, 7), (10, 11), (4, 5)):  # a few likely tokens, so that some have pi > 0.5
        table[row, token] += 3.0
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
    }
    return table, inputs


def test_token_weights_match_autograd_of_trl_loss():
    generator = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 5, generator=generator) * 4
    old = logps + 0.5 * torch.randn(3, 5, generator=generator)  # ratios far from 1: some tokens clip
    ref = logps + 0.7 * torch.randn(3, 5, generator=generator)
    advantages = torch.tensor([1.5, -0.8, 0.3])
    for bias_correction in (False, True):
        leaf = logps.clone().requires_grad_(True)
        loss = reference_token_loss(leaf, old, advantages[:, None], ref, 0.2, 0.2, 0.28, bias_correction)
        (grad,) = torch.autograd.grad(loss.sum(), leaf)
        w_pg, w_kl = grpo_token_weights(logps, old, advantages, ref, 0.2, 0.2, 0.28, bias_correction)
        torch.testing.assert_close(w_pg + w_kl, -grad, rtol=1e-5, atol=1e-6)
        # without KL: the same derivative with beta = 0
        leaf = logps.clone().requires_grad_(True)
        loss = reference_token_loss(leaf, old, advantages[:, None], ref, 0.0, 0.2, 0.28, bias_correction)
        (grad,) = torch.autograd.grad(loss.sum(), leaf)
        torch.testing.assert_close(w_pg, -grad, rtol=1e-5, atol=1e-6)
    ratio = torch.exp(logps - old)
    clipped = ((advantages[:, None] > 0) & (ratio > 1.28)) | ((advantages[:, None] < 0) & (ratio < 0.8))
    assert clipped.any() and (~clipped).any()
    # plain k3: w_kl = beta * (pi_ref / pi - 1)
    _, w_kl = grpo_token_weights(logps, old, advantages, ref, 0.2, use_bias_correction_kl=False)
    torch.testing.assert_close(w_kl, 0.2 * (torch.exp(ref - logps) - 1))


def test_hidden_gradient_closed_form_on_a_softmax_layer():
    """With W = I the norm is ||e_k - p|| / T (times |w| for the loss), in [(1 - pi) / T, sqrt(2) (1 - pi) / T]."""
    generator = torch.Generator().manual_seed(1)
    vocab_size = 11
    logits = 3.0 * torch.randn(2, 6, vocab_size, generator=generator)
    logits[0, 0, 4] = 30.0  # a token with probability ~1 keeps its precision
    tokens = torch.randint(0, vocab_size, (2, 6), generator=generator)
    tokens[0, 0] = 4
    norms, logps, one_minus_p = hidden_state_gradient_norms(logits, tokens, torch.eye(vocab_size), TEMPERATURE)
    p = numpy_softmax(logits.double().numpy() / TEMPERATURE)
    onehot = np.eye(vocab_size)[tokens.numpy()]
    expected = np.linalg.norm(onehot - p, axis=-1) / TEMPERATURE
    pi = np.take_along_axis(p, tokens.numpy()[..., None], -1)[..., 0]
    np.testing.assert_allclose(logps.numpy(), np.log(pi), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norms.numpy(), expected, rtol=1e-4, atol=1e-12)
    one_minus_pi = (p * (1 - onehot)).sum(-1)  # the other tokens' probabilities: precise also when pi ~ 1
    np.testing.assert_allclose(one_minus_p.numpy(), one_minus_pi, rtol=1e-5)
    assert np.all(norms.numpy() * TEMPERATURE >= one_minus_pi * (1 - 1e-4))
    assert np.all(norms.numpy() * TEMPERATURE <= math.sqrt(2) * one_minus_pi * (1 + 1e-4))
    assert 0 < norms[0, 0] < 1e-9 and logps[0, 0] == 0  # 1 - pi ~ 1e-18, invisible in float32 log pi but kept


def test_quartile_report_on_a_softmax_layer():
    table, inputs = softmax_batch(seed=2)
    model = SoftmaxLM(table)
    generator = torch.Generator().manual_seed(3)
    inputs["old_per_token_logps"] = -torch.rand(4, 3, generator=generator) * 3
    inputs["ref_per_token_logps"] = -torch.rand(4, 3, generator=generator) * 3
    beta, eps = 0.3, 0.2
    report = measure_token_gradients(model, inputs, temperature=TEMPERATURE, beta=beta, epsilon_low=eps)

    # independent computation, token by token
    mask = inputs["completion_mask"].bool().numpy()
    inputs_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1).numpy()
    rows = inputs_ids[:, :-1]  # the token that predicts each completion token
    p = numpy_softmax(table.double().numpy()[rows] / TEMPERATURE)
    k = inputs["completion_ids"].numpy()
    pi = np.take_along_axis(p, k[..., None], -1)[..., 0]
    logps = torch.tensor(np.log(pi), requires_grad=True)
    loss = reference_token_loss(
        logps, inputs["old_per_token_logps"].double(), inputs["advantages"].double()[:, None],
        inputs["ref_per_token_logps"].double(), beta, eps, eps, True,
    )
    (dloss,) = torch.autograd.grad(loss.sum(), logps)
    w = -dloss.numpy()
    loss_no_kl = reference_token_loss(
        logps, inputs["old_per_token_logps"].double(), inputs["advantages"].double()[:, None],
        inputs["ref_per_token_logps"].double(), 0.0, eps, eps, True,
    )
    (dloss,) = torch.autograd.grad(loss_no_kl.sum(), logps)
    w_no_kl = -dloss.numpy()
    unit = np.linalg.norm(np.eye(table.size(0))[k] - p, axis=-1) / TEMPERATURE
    pi_old = np.exp(inputs["old_per_token_logps"].double().numpy())[mask]
    edges = np.quantile(pi_old, [0.25, 0.5, 0.75])
    np.testing.assert_allclose(report["quartile_edges"], edges, rtol=1e-6)
    group = np.searchsorted(edges, pi_old, side="right")
    assert sum(row["count"] for row in report["quartiles"]) == mask.sum() == 11
    for j, row in enumerate(report["quartiles"]):
        selected = group == j
        assert row["count"] == selected.sum()
        np.testing.assert_allclose(row["abs_w_mean"], np.abs(w[mask][selected]).mean(), rtol=1e-4)
        np.testing.assert_allclose(row["abs_w_median"], np.median(np.abs(w[mask][selected])), rtol=1e-4)
        np.testing.assert_allclose(row["abs_w_no_kl_mean"], np.abs(w_no_kl[mask][selected]).mean(), rtol=1e-4)
        np.testing.assert_allclose(
            row["hidden_grad_norm_mean"], (np.abs(w) * unit)[mask][selected].mean(), rtol=1e-4, atol=1e-10
        )
        ratio = (unit / (p * (1 - np.eye(table.size(0))[k])).sum(-1))[mask][selected]
        np.testing.assert_allclose(row["ratio_to_one_minus_p_mean"], ratio.mean(), rtol=1e-4)
        assert 1 / TEMPERATURE * (1 - 1e-4) <= row["ratio_to_one_minus_p_mean"]
        assert row["ratio_to_one_minus_p_max"] <= report["bound"]["ratio_to_one_minus_p_upper_bound"] * (1 + 1e-5)
    np.testing.assert_allclose(report["bound"]["ratio_to_one_minus_p_upper_bound"], math.sqrt(2) / TEMPERATURE)

    # summed gradients w.r.t. the table: row x of token t gets c_t * dloss_t/dlogp_t * (e_k - p_t) / T (dapo: c = 1/N)
    coefficient = -w / mask.sum()  # d(batch loss) / d logp_t
    token_group = np.searchsorted(edges, np.exp(inputs["old_per_token_logps"].double().numpy()), side="right")
    grads = []
    for j in range(4):
        grad = np.zeros_like(table.double().numpy())
        for b, t in zip(*np.nonzero(mask & (token_group == j))):
            grad[rows[b, t]] += coefficient[b, t] * (np.eye(table.size(0))[k[b, t]] - p[b, t]) / TEMPERATURE
        grads.append(grad.reshape(-1))
    full = sum(grads)
    np.testing.assert_allclose(report["full_grad_norm"], np.linalg.norm(full), rtol=1e-3)  # float32 vs float64
    for j, row in enumerate(report["quartiles"]):
        np.testing.assert_allclose(row["summed_grad_norm"], np.linalg.norm(grads[j]), rtol=1e-3)
        cosine = grads[j] @ full / (np.linalg.norm(grads[j]) * np.linalg.norm(full))
        np.testing.assert_allclose(row["cos_with_full"], cosine, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(row["contribution_to_full"], grads[j] @ full / (full @ full), rtol=1e-3, atol=1e-5)
    assert sum(row["contribution_to_full"] for row in report["quartiles"]) == pytest.approx(1.0, abs=1e-5)


def test_quartile_assignment_orders_tokens():
    generator = torch.Generator().manual_seed(4)
    probs = torch.rand(6, 9, generator=generator)
    mask = torch.rand(6, 9, generator=generator) > 0.2
    edges, group = probability_quartiles(probs, mask)
    values = probs[mask].double().numpy()
    np.testing.assert_allclose(edges.numpy(), np.quantile(values, [0.25, 0.5, 0.75]))
    assert (group[~mask] == -1).all()
    counts = [int((group == j).sum()) for j in range(4)]
    assert sum(counts) == mask.sum() and max(counts) - min(counts) <= 1
    for j in range(3):  # every token of a lower group has a lower probability than every token of the next group
        assert probs[group == j].max() < probs[group == j + 1].min()


@pytest.fixture(scope="module")
def tiny_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():  # sharper distributions than the random init, so the quartiles differ
        model.lm_head.weight.mul_(40.0)
    return model.eval()


def tiny_batch(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    vocab_size = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab_size, (4, 5), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0  # left padding
    prompt_mask[2, :1] = 0
    completion_ids = torch.randint(3, vocab_size, (4, 6), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 4:] = 0
    completion_mask[3, 3:] = 0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.2, -0.7, 0.4, -1.0]),
    }


def test_closed_form_matches_autograd_and_summed_gradients_match_direct(tiny_model):
    """On a tiny Qwen2: hidden-state gradients against autograd, summed parameter gradients against masked losses."""
    model = tiny_model
    inputs = tiny_batch(model)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    captured = {}
    hook = model.lm_head.register_forward_hook(lambda module, args, output: captured.update(h=args[0]))
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    hook.remove()
    T = inputs["completion_ids"].size(1)
    logps_all = torch.log_softmax(logits[:, -T - 1 : -1].float() / TEMPERATURE, -1)
    logps = logps_all.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    norms, closed_logps, _ = hidden_state_gradient_norms(
        logits[:, -T - 1 : -1], inputs["completion_ids"], model.lm_head.weight, TEMPERATURE
    )
    torch.testing.assert_close(closed_logps.float(), logps.detach(), rtol=1e-5, atol=1e-5)
    hidden = captured["h"]
    for b, t in [(0, 0), (1, 3), (2, 5), (3, 1)]:
        (grad,) = torch.autograd.grad(logps[b, t], hidden, retain_graph=True)
        position = hidden.size(1) - T - 1 + t
        assert grad[:, :position].abs().max() == 0  # causal: earlier positions are untouched
        # w.r.t. the hidden state at its own position: the closed form
        torch.testing.assert_close(grad[b, position].norm(), norms[b, t], rtol=1e-4, atol=1e-7)

    # summed gradients per quartile against direct masked losses (off-policy pi_old, a reference: clipping and KL)
    generator = torch.Generator().manual_seed(5)
    mask = inputs["completion_mask"].bool()
    inputs["old_per_token_logps"] = (logps.detach() + 0.4 * torch.randn(logps.shape, generator=generator)) * mask
    inputs["ref_per_token_logps"] = (logps.detach() + 0.4 * torch.randn(logps.shape, generator=generator)) * mask
    beta = 0.2
    report = measure_token_gradients(
        model, inputs, temperature=TEMPERATURE, beta=beta, epsilon_low=0.2, epsilon_high=0.28, loss_type="grpo",
        micro_batch_size=3,
    )
    pi_old = inputs["old_per_token_logps"].exp()
    edges = np.quantile(pi_old[mask].double().numpy(), [0.25, 0.5, 0.75])
    group = torch.from_numpy(np.searchsorted(edges, pi_old.double().numpy(), side="right"))
    per_token = reference_token_loss(
        logps, inputs["old_per_token_logps"], inputs["advantages"][:, None], inputs["ref_per_token_logps"], beta,
        0.2, 0.28, True,
    )
    lengths = mask.sum(-1, keepdim=True).float()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for j in range(4):
        active = (mask & (group == j)).float()
        loss = ((per_token * active) / lengths).sum(-1).mean()  # "grpo": per-sequence mean, then batch mean
        g = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        grads.append(torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1) for x, p in zip(g, params)]))
    full = sum(grads)
    torch.testing.assert_close(torch.tensor(report["full_grad_norm"]), full.norm(), rtol=2e-3, atol=1e-7)
    for j, row in enumerate(report["quartiles"]):
        assert row["count"] == int((mask & (group == j)).sum())
        torch.testing.assert_close(torch.tensor(row["summed_grad_norm"]), grads[j].norm(), rtol=2e-3, atol=1e-7)
        for i in range(4):
            cosine = torch.nn.functional.cosine_similarity(grads[i], grads[j], dim=0)
            assert report["summed_grad_cosine"][i][j] == pytest.approx(float(cosine), abs=2e-3)


def test_probe_bookkeeping_on_a_softmax_layer():
    """Every token has its own row: an update on a set of tokens moves exactly those tokens, with their advantage."""
    table, inputs = softmax_batch(seed=6)
    model = SoftmaxLM(table)
    lr = 5.0
    probe = probability_shift_probe(
        model, inputs, methods=("grpo", "ar", "lopti", "lowest_quartile_only", "highest_quartile_only"), lr=lr,
        alpha=0.3, eta=0.5, temperature=TEMPERATURE,
    )
    torch.testing.assert_close(model.embed.weight.data, table)  # the model itself is untouched

    mask = inputs["completion_mask"].bool().numpy()
    rows = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1).numpy()[:, :-1]
    k = inputs["completion_ids"].numpy()
    advantages = np.broadcast_to(inputs["advantages"].numpy()[:, None], k.shape)
    table_np = table.double().numpy()
    p = numpy_softmax(table_np[rows] / TEMPERATURE)
    pi = np.take_along_axis(p, k[..., None], -1)[..., 0]
    edges = np.quantile(pi[mask], [0.25, 0.5, 0.75])
    group = np.where(mask, np.searchsorted(edges, pi, side="right"), -1)
    n = mask.sum()

    def shifted(active, weight):
        new = table_np.copy()
        for b, t in zip(*np.nonzero(active)):  # SGD on row x: += lr * c * w * (e_k - p) / T, c = 1/N (dapo)
            new[rows[b, t]] += lr * weight[b, t] / n * (np.eye(len(new))[k[b, t]] - p[b, t]) / TEMPERATURE
        new_p = numpy_softmax(new[rows] / TEMPERATURE)
        return np.take_along_axis(new_p, k[..., None], -1)[..., 0] - pi

    ar_weight = advantages * (0.3 * pi + 0.7)
    expected = {
        "grpo": shifted(mask, advantages),
        "ar": shifted(mask, ar_weight),
        "lopti": shifted(mask, advantages),  # rows are independent: the two passes add up to one GRPO step
        "lowest_quartile_only": shifted(group == 0, advantages),
        "highest_quartile_only": shifted(group == 3, advantages),
    }
    assert probe["token_counts"] == {"positive": int((mask & (advantages > 0)).sum()),
                                      "negative": int((mask & (advantages < 0)).sum())}
    assert probe["low_token_count"] == int((mask & (pi < 0.5)).sum())
    assert 0 < probe["low_token_count"] < n
    for method, delta in expected.items():
        groups = probe["methods"][method]["groups"]
        for j in range(4):
            for sign, selector in (("positive", advantages > 0), ("negative", advantages < 0)):
                tokens = (group == j) & selector
                entry = groups[f"q{j}"][sign]
                assert entry["count"] == tokens.sum()
                if not tokens.any():
                    assert entry["share_in_direction"] is None
                    continue
                np.testing.assert_allclose(entry["mean_delta_prob"], delta[tokens].mean(), rtol=1e-3, atol=1e-8)
                moved = np.sign(delta[tokens]) == (1 if sign == "positive" else -1)
                assert entry["share_in_direction"] == pytest.approx(moved.mean())
        if method.endswith("_only"):  # tokens outside the updated quartile do not move at all
            quartile = 0 if method.startswith("lowest") else 3
            for j in set(range(4)) - {quartile}:
                for sign in ("positive", "negative"):
                    entry = groups[f"q{j}"][sign]
                    assert entry["count"] == 0 or (entry["share_in_direction"] == 0 and entry["mean_delta_prob"] == 0)
        else:  # every token moves with its advantage
            assert groups["all"]["positive"]["share_in_direction"] == 1.0
            assert groups["all"]["negative"]["share_in_direction"] == 1.0


def test_lopti_probe_second_pass_is_relative_to_pi_old(tiny_model):
    """On a model whose tokens interact, Lopti's second step starts from the first step's parameters: it differs
    from a GRPO step, and the grpo/lowest/highest probes reuse the quartile gradients consistently."""
    inputs = tiny_batch(tiny_model, seed=1)
    probs = report_logps(tiny_model, inputs)[inputs["completion_mask"].bool()].exp()
    eta = threshold_between_values(probs)  # about half the tokens are "low", none of them near eta
    report = run_token_diagnostics(
        tiny_model, inputs, temperature=TEMPERATURE, lr=0.5, eta=eta,
        probe_methods=("grpo", "lopti", "lowest_quartile_only", "highest_quartile_only"), micro_batch_size=2,
    )
    gradients, probe = report["gradients"], report["probe"]
    assert 0 < probe["low_token_count"] < gradients["num_tokens"]
    methods = probe["methods"]
    # one SGD step moves the parameters by lr * ||gradient||
    assert methods["grpo"]["update_norm"] == pytest.approx(0.5 * gradients["full_grad_norm"], rel=1e-4)
    assert methods["lowest_quartile_only"]["update_norm"] == pytest.approx(
        0.5 * gradients["quartiles"][0]["summed_grad_norm"], rel=1e-4)
    assert methods["highest_quartile_only"]["update_norm"] == pytest.approx(
        0.5 * gradients["quartiles"][3]["summed_grad_norm"], rel=1e-4)
    lopti = methods["lopti"]["groups"]["all"]["positive"]["mean_delta_prob"]
    assert lopti != pytest.approx(methods["grpo"]["groups"]["all"]["positive"]["mean_delta_prob"], rel=1e-6)


def test_shared_prompt_forward_gives_the_same_report(tiny_model):
    """Running a prompt once for its completions (key/value cache shared, gradients through it) changes nothing."""
    inputs = tiny_batch(tiny_model, seed=2)
    order = [0, 0, 2, 2]  # two prompts (one left-padded), two completions each
    inputs["prompt_ids"], inputs["prompt_mask"] = inputs["prompt_ids"][order], inputs["prompt_mask"][order]
    eta = threshold_between_values(report_logps(tiny_model, inputs)[inputs["completion_mask"].bool()].exp())
    kwargs = dict(temperature=TEMPERATURE, beta=0.0, lr=0.5, probe_methods=("grpo", "lopti"), eta=eta,
                  micro_batch_size=4)
    shared = run_token_diagnostics(tiny_model, inputs, share_prompt_forward=True, **kwargs)
    full = run_token_diagnostics(tiny_model, inputs, share_prompt_forward=False, **kwargs)
    for a, b in zip(shared["gradients"]["quartiles"], full["gradients"]["quartiles"]):
        assert a["count"] == b["count"]
        for key in ("abs_w_mean", "hidden_grad_norm_mean", "summed_grad_norm", "cos_with_full"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7)
    for method in ("grpo", "lopti"):
        a = shared["probe"]["methods"][method]["groups"]["all"]["positive"]["mean_delta_prob"]
        b = full["probe"]["methods"][method]["groups"]["all"]["positive"]["mean_delta_prob"]
        assert a == pytest.approx(b, rel=1e-3, abs=1e-9)


def report_logps(model, inputs):
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    T = inputs["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -T - 1 : -1]
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]


def test_inner_steps_make_ratio_clipping_and_kl_visible(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model)
    inputs = tiny_batch(model, seed=3)
    before = report_logps(model, inputs)
    info = advance_policy_on_batch(model, inputs, 2, 1e-2, temperature=TEMPERATURE, beta=0.5)
    mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(inputs["old_per_token_logps"][mask], before[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inputs["ref_per_token_logps"], inputs["old_per_token_logps"])
    assert info["update_norm"] > 0
    report = measure_token_gradients(model, inputs, temperature=TEMPERATURE, beta=0.5, summed_gradients=False)
    assert report["kl_reference"] == "inputs"
    assert all(row["abs_w_kl_part_mean"] > 0 for row in report["quartiles"])
    assert any(row["abs_w_mean"] != pytest.approx(row["abs_w_no_kl_mean"]) for row in report["quartiles"])
    ratio = torch.exp(report_logps(model, inputs) - inputs["old_per_token_logps"])
    advantages = inputs["advantages"][:, None]
    clipped = ((ratio > 1.2) & (advantages > 0)) | ((ratio < 0.8) & (advantages < 0))
    assert 0 < clipped[mask].sum() < mask.sum()
    assert sum(row["clipped_share"] * row["count"] for row in report["quartiles"]) == pytest.approx(
        float(clipped[mask].sum()), abs=1e-6)  # every advantage is non-zero here


def by_kind_reward(completions, kind, **kwargs):
    """Completion length for the rows of kind "length", 1.0 for those of kind "constant"."""
    return [float(len(c)) if k == "length" else 1.0 for c, k in zip(completions, kind, strict=True)]


def test_batch_from_trl_has_group_normalised_advantages(tiny_model_path, tmp_path):
    """The diagnose command's batch is the trainer's: advantages `(r - group mean) / (group std + 1e-4)`, zero (never
    NaN) for a group whose rewards are all equal, the completion mask up to the first EOS, rows grouped by prompt."""
    from datasets import Dataset

    rows = [{"prompt": "ab cd", "kind": "length"}, {"prompt": "xy", "kind": "constant"}]
    config = LoptiGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                             max_completion_length=8, seed=3, use_cpu=True, report_to="none")  # fmt: skip
    trainer = LoptiGRPOTrainer(model=tiny_model_path, reward_funcs=by_kind_reward, args=config,
                               train_dataset=Dataset.from_list(rows))  # fmt: skip
    inputs, summary = sample_generation_batch(trainer, rows)
    rewards = torch.tensor(summary["rewards"]).view(2, 4)
    assert summary["num_completions"] == 8 and inputs["completion_ids"].size(0) == 8
    assert rewards[0].std() > 0 and torch.equal(rewards[1], torch.ones(4))  # the completions' lengths differ
    expected = (rewards[0] - rewards[0].mean()) / (rewards[0].std() + 1e-4)
    torch.testing.assert_close(inputs["advantages"][:4].cpu(), expected)
    assert torch.equal(inputs["advantages"][4:].cpu(), torch.zeros(4))
    assert summary["num_zero_advantage_completions"] == 4 + int((expected == 0).sum())
    # the mask ends at the first EOS (included); tokens after it are padding
    eos = trainer.processing_class.eos_token_id
    for ids, mask in zip(inputs["completion_ids"], inputs["completion_mask"]):
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any()
        assert eos not in ids[: length - 1].tolist()
    # both prompts: every row of a group holds the same prompt
    prompts = [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(inputs["prompt_ids"], inputs["prompt_mask"])]
    assert len(set(prompts[:4])) == 1 and len(set(prompts[4:])) == 1 and prompts[0] != prompts[4]


def test_settings_validate_and_override():
    settings = DiagnosticsSettings(temperature=0.7, beta=0.1)
    assert DiagnosticsSettings.resolve(settings, beta=0.2) == DiagnosticsSettings(temperature=0.7, beta=0.2)
    assert settings.beta == 0.1  # resolve copies
    with pytest.raises(ValueError, match="loss_type"):
        DiagnosticsSettings(loss_type="sapo")
    with pytest.raises(ValueError, match="micro_batch_size"):
        DiagnosticsSettings(micro_batch_size=0)
    with pytest.raises(ValueError, match="temperature"):
        DiagnosticsSettings.resolve(None, temperature=0.0)


def test_diagnose_cli_end_to_end(tiny_model_path, tmp_path):
    output_dir = tmp_path / "toy"
    argv = ["--model_name_or_path", tiny_model_path, "--task", "toy", "--per_device_train_batch_size", "6",
            "--num_generations", "3", "--max_completion_length", "6", "--probe_lr", "0.1", "--output_dir",
            str(output_dir), "--seed", "1"]  # fmt: skip
    assert diagnose_main(argv + ["--inner_steps", "1", "--inner_lr", "1e-3", "--beta", "0.1"]) == 0
    report = json.loads((output_dir / "report.json").read_text())
    assert report["inner_steps"]["steps"] == 1 and report["inner_steps"]["update_norm"] > 0
    assert report["gradients"]["kl_reference"] == "inputs"
    assert (output_dir / "gradients.png").stat().st_size > 0
    assert (output_dir / "probability_shift.png").stat().st_size > 0
    assert "| Q1 (lowest) |" in (output_dir / "report.md").read_text()
    gradients = report["gradients"]
    assert gradients["num_completions"] == 6
    assert sum(row["count"] for row in gradients["quartiles"]) == gradients["num_tokens"] > 0
    assert set(report["probe"]["methods"]) == {"grpo", "ar", "lopti", "lowest_quartile_only", "highest_quartile_only"}
    assert report["generation"]["num_completions"] == 6

    # all rewards equal: zero advantages everywhere, and a report without NaN (json refuses NaN when writing)
    output_dir = tmp_path / "constant"
    argv[argv.index(str(tmp_path / "toy"))] = str(output_dir)
    assert diagnose_main(argv + ["--reward", "constant", "--beta", "0.1", "--probe_methods", "grpo,lopti",
                                 "--no_plots"]) == 0
    report = json.loads((output_dir / "report.json").read_text())
    assert report["generation"]["num_zero_advantage_completions"] == 6
    assert all(row["abs_w_no_kl_mean"] == 0 for row in report["gradients"]["quartiles"])
    # the KL part against TRL's reference (the starting policy, float32 log-probabilities) is rounding noise
    assert report["gradients"]["kl_reference"] == "inputs"
    assert all(row["abs_w_mean"] < 1e-6 for row in report["gradients"]["quartiles"])
    assert report["gradients"]["full_grad_norm"] < 1e-6
    assert report["probe"]["methods"]["grpo"]["groups"]["all"]["positive"]["share_in_direction"] is None


def test_diagnose_cli_knights_knaves(tiny_model_path, tmp_path, run_cli):
    argv = ["diagnose", "--model_name_or_path", tiny_model_path, "--task", "knights_knaves",
            "--per_device_train_batch_size", "2", "--num_generations", "2", "--temperature", "0.7", "--epsilon_high",
            "0.28", "--loss_type", "grpo", "--use_bias_correction_kl", "false", "--advantage_reweighting_alpha", "0.2",
            "--lopti_threshold", "0.4", "--max_completion_length", "4", "--no_summed_gradients", "--probe_methods",
            "none", "--no_plots", "--output_dir", str(tmp_path)]
    code, out, err = run_cli(argv)
    assert code == 0, err
    assert "| Q1 (lowest) |" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["generation"]["num_completions"] == 2
    assert report["probe"] is None and "summed_grad_norm" not in report["gradients"]["quartiles"][0]
    # the measured loss is the one the parsed LoptiGRPOConfig trains (one name per setting)
    settings = report["gradients"]["settings"]
    assert {key: settings[key] for key in ("temperature", "epsilon_low", "epsilon_high", "loss_type",
                                           "use_bias_correction_kl", "alpha", "eta")} == {
        "temperature": 0.7, "epsilon_low": 0.2, "epsilon_high": 0.28, "loss_type": "grpo",
        "use_bias_correction_kl": False, "alpha": 0.2, "eta": 0.4}  # fmt: skip


def test_diagnose_cli_errors_name_the_field(tiny_model_path, run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    base = ["diagnose", "--model_name_or_path", tiny_model_path]
    code, _, err = run_cli(base + ["--num_generations", "1"])
    assert code == 2 and "at least 2 generations per prompt" in err  # TRL's GRPOConfig check, at parsing
    code, _, err = run_cli(base + ["--probe_methods", "grpo,lopti,sideways"])
    assert code == 2 and "probe_methods" in err and "'sideways'" in err
    code, _, err = run_cli(base + ["--loss_type", "sapo"])
    assert code == 2 and "refusing to measure a run that trains with loss_type='sapo'" in err
    code, _, err = run_cli(base + ["--lopti_threshold", "None"])
    assert code == 2 and "the Lopti probes need Lopti on" in err
    code, _, err = run_cli(base + ["--eta", "0.4"])
    assert code == 2 and "eta" in err  # argparse or TRL's parser names the flag
    code, _, err = run_cli(["diagnose", "--task", "toy"])
    assert code == 2 and "--model_name_or_path" in err


TRL_LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")


@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_settings_follow_the_trained_loss_or_refuse_it(tiny_model_path, tmp_path, loss_type):
    """Every TRL 1.16 loss type: measured with its own normaliser, or refused by name (never measured as another)."""
    from datasets import Dataset

    config = LoptiGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                             max_completion_length=4, loss_type=loss_type, epsilon_high=0.28, beta=0.04,
                             use_bias_correction_kl=False, temperature=0.7, advantage_reweighting_alpha=0.2,
                             lopti_threshold=0.4, use_cpu=True, report_to="none")  # fmt: skip
    trainer = LoptiGRPOTrainer(model=tiny_model_path, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=config, train_dataset=Dataset.from_dict({"prompt": ["ab"] * 4}))  # fmt: skip
    if loss_type in SUPPORTED_LOSS_TYPES:
        settings = DiagnosticsSettings.from_trainer(trainer, micro_batch_size=2)
        assert (settings.loss_type, settings.temperature, settings.beta, settings.epsilon_low, settings.epsilon_high,
                settings.use_bias_correction_kl, settings.alpha, settings.eta, settings.micro_batch_size) == (
            loss_type, 0.7, 0.04, 0.2, 0.28, False, 0.2, 0.4, 2)  # fmt: skip
        assert unmodelled_loss_settings(config) == []
        TokenDiagnosticsCallback(trainer)  # accepted
    else:
        message = f"refusing to measure a run that trains with loss_type={loss_type!r}"
        with pytest.raises(ValueError, match=message):
            DiagnosticsSettings.from_trainer(trainer)
        with pytest.raises(ValueError, match=message):
            TokenDiagnosticsCallback(trainer)


@pytest.mark.parametrize(
    "option, named",
    [
        (dict(importance_sampling_level="sequence"), "importance_sampling_level='sequence'"),
        (dict(delta=2.0), "delta=2.0"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold=0.5"),
        (dict(entropy_coef=0.01), "entropy_coef=0.01"),
    ],
)
def test_settings_refuse_loss_options_they_do_not_model(tmp_path, option, named):
    config = LoptiGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                             use_cpu=True, report_to="none", **option)  # fmt: skip
    assert unmodelled_loss_settings(config) == [named] or named in unmodelled_loss_settings(config)[0]


def test_callback_logs_diagnostics_during_training(tiny_model_path, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions, **kwargs):
        return [float(len(str(c))) for c in completions]

    config = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=2, logging_steps=1, report_to="none", use_cpu=True, bf16=False, beta=0.1, save_strategy="no",
    )
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"] * 4}))
    callback = TokenDiagnosticsCallback(trainer, every_n_steps=1, summed_gradients=True)
    trainer.add_callback(callback)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "diagnostics/abs_w_mean_q1" in entry]
    assert len(logged) == 2
    assert "diagnostics/summed_grad_norm_q4" in logged[0] and "diagnostics/quartile_edge_2" in logged[0]
    report = callback.last_report
    assert report["kl_reference"] == "inputs"  # TRL's reference log-probabilities were used
    assert sum(row["count"] for row in report["quartiles"]) == report["num_tokens"] > 0


@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
@pytest.mark.parametrize("use_bias_correction_kl", [True, False])
def test_modelled_token_weights_are_the_gradient_of_trl_loss(tiny_model_path, tmp_path, loss_type,
                                                             use_bias_correction_kl):  # fmt: skip
    """For every loss type the diagnostics accept, `-(w_pg + w_kl) * c_t` is exactly `d loss / d log pi_t` of TRL's own
    `GRPOTrainer._compute_loss` (clipping on both sides, KL term, the loss type's normaliser, a padded completion)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from trl_lopti.diagnostics import loss_normalizer

    generator = torch.Generator().manual_seed(0)
    batch_size, num_tokens = 4, 5
    mask = torch.ones(batch_size, num_tokens, dtype=torch.long)
    mask[1, 3:] = 0
    old = torch.log(torch.rand(batch_size, num_tokens, generator=generator) * 0.9 + 0.05)
    logps = old + torch.randn(batch_size, num_tokens, generator=generator) * 0.4  # ratios on both sides of the clip
    ref = old + torch.randn(batch_size, num_tokens, generator=generator) * 0.3
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])
    inputs = {
        "prompt_ids": torch.ones(batch_size, 2, dtype=torch.long), "prompt_mask": torch.ones(batch_size, 2),
        "completion_ids": torch.ones(batch_size, num_tokens, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    config = LoptiGRPOConfig(output_dir=str(tmp_path), loss_type=loss_type, beta=0.3, epsilon=0.2, epsilon_high=0.28,
                             use_bias_correction_kl=use_bias_correction_kl, max_completion_length=8, use_cpu=True,
                             per_device_train_batch_size=4, num_generations=4, report_to="none")  # fmt: skip
    trainer = LoptiGRPOTrainer(model=tiny_model_path, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=config, train_dataset=Dataset.from_dict({"prompt": ["ab"] * 4}))  # fmt: skip
    leaf = logps.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (leaf, torch.zeros_like(leaf), None)
    trainer.model.eval()  # no gradient-accumulation factor in TRL's normalisers
    loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    (trl_gradient,) = torch.autograd.grad(loss, leaf)

    settings = DiagnosticsSettings.from_trainer(trainer)
    w_pg, w_kl = grpo_token_weights(logps, old, advantages, ref, settings.beta, settings.epsilon_low,
                                    settings.epsilon_high, settings.use_bias_correction_kl)  # fmt: skip
    modelled = -(w_pg + w_kl) * loss_normalizer(mask, loss_type, settings.max_completion_length)
    assert bool((w_pg == 0).any()) and bool((w_pg != 0).any())  # some tokens clipped, some not
    torch.testing.assert_close(modelled, trl_gradient, rtol=1e-5, atol=1e-7)


def test_quantile_split_of_the_config_drives_the_lopti_probe(tiny_model_path, tmp_path):
    """A run with `lopti_quantile` is probed with its own split: eta is that quantile of the batch's pi_old."""
    from datasets import Dataset

    config = LoptiGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                             max_completion_length=6, lopti_threshold=None, lopti_quantile=0.25,
                             temperature=TEMPERATURE, use_cpu=True, report_to="none", seed=0)  # fmt: skip
    rows = [{"prompt": "ab cd", "kind": "length"}, {"prompt": "xy", "kind": "length"}]
    trainer = LoptiGRPOTrainer(model=tiny_model_path, reward_funcs=by_kind_reward, args=config,
                               train_dataset=Dataset.from_list(rows))  # fmt: skip
    settings = DiagnosticsSettings.from_trainer(trainer)
    assert settings.lopti_quantile == 0.25
    inputs, _ = sample_generation_batch(trainer, rows)
    report = run_token_diagnostics(trainer.model.eval(), inputs, None, settings, summed_gradients=False,
                                   probe_methods=["lopti"])  # fmt: skip
    probe = report["probe"]
    logps = inputs.get("old_per_token_logps")  # the batch's pi_old: the trainer's, else (on-policy) the model's
    logps = completion_log_probs(trainer.model, inputs, TEMPERATURE) if logps is None else logps.double()
    mask = inputs["completion_mask"].bool()
    expected_eta = float(torch.quantile(logps.exp()[mask], 0.25))
    assert probe["lopti_quantile"] == 0.25 and probe["eta"] == pytest.approx(expected_eta, rel=1e-5)
    probs = logps.exp()[mask]
    near = int(((probs - probe["eta"]).abs() < 1e-5).sum())  # float rounding may put these on either side
    assert abs(probe["low_token_count"] - int((probs < probe["eta"]).sum())) <= near
    assert 0 < probe["low_token_count"] < int(mask.sum())
