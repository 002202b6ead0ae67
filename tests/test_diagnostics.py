"""Token-probability diagnostics (`trl_lopti.diagnostics`, `trl-lopti diagnose`) against the trainer's own backward
pass, closed forms and independent updates, on batches that TRL generates, scores and gives advantages to."""

import json
from unittest import mock

import numpy as np
import pytest
import torch
from datasets import Dataset
from testing_utils import FLOAT64, use_exact_log_prob_head
from trl import GRPOConfig, GRPOTrainer

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer
from trl_lopti.cli.diagnose import main as diagnose_main
from trl_lopti.core_algos import isolate_token_gradients, reweight_advantages
from trl_lopti.diagnostics import (
    TokenDiagnosticsCallback,
    advance_policy_on_batch,
    completion_log_probs,
    hidden_state_gradient_norms,
    probability_quartiles,
    probability_shift,
    run_token_diagnostics,
    sample_generation_batch,
    summed_parameter_gradients,
    trl_loss_gradients,
)
from trl_lopti.tasks import completion_to_text


pytestmark = pytest.mark.usefixtures("single_thread")

ROWS = [{"prompt": "ab cd"}, {"prompt": "xy"}]
TEMPERATURE = 0.7


def length_reward(completions, **kwargs):
    """The completion's length in characters: rewards that differ within a group on any model."""
    return [float(len(completion_to_text(completion))) for completion in completions]


def make_trainer(model_path, tmp_path, trainer_class=GRPOTrainer, **overrides):
    """A trainer on the tiny model in float64 with an exact log-prob head (`use_exact_log_prob_head`), 8 completions
    (2 prompts x 4) of up to 6 tokens per generation batch."""
    config = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        temperature=TEMPERATURE,
        use_cpu=True,
        report_to="none",
        seed=0,
        **FLOAT64,
    )
    config_class = GRPOConfig if trainer_class is GRPOTrainer else LoptiGRPOConfig
    trainer = trainer_class(
        model=model_path,
        reward_funcs=length_reward,
        args=config_class(**{**config, **overrides}),
        train_dataset=Dataset.from_list(ROWS),
    )
    use_exact_log_prob_head(trainer)
    return trainer


def off_policy_batch(trainer, lr=0.05):
    """A generation batch of the trainer, then one Adam step on it: ratios away from 1, clipping, a KL part."""
    torch.manual_seed(0)
    inputs, _ = sample_generation_batch(trainer, ROWS)
    advance_policy_on_batch(trainer, inputs, steps=1, lr=lr)
    return inputs


def trl_values(trainer, inputs):
    """Log-probabilities and entropies of the batch by TRL's own forward, no gradient."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=True
        )
    return logps, entropies


def quartiles(probs, mask):
    """Quartile index of every token by numpy (np.quantile, linear), -1 outside the mask."""
    values = probs.double().numpy()
    edges = np.quantile(values[mask.numpy()], [0.25, 0.5, 0.75])
    return torch.from_numpy(np.where(mask.numpy(), np.searchsorted(edges, values, side="right"), -1)), edges


TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LOSS_CASES = [
    *[dict(loss_type=loss_type) for loss_type in TRL_LOSS_TYPES],
    dict(loss_type="grpo", importance_sampling_level="sequence"),
    dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.05, delta=1.5, off_policy_mask_threshold=0.01),
]


@pytest.mark.parametrize("options", LOSS_CASES, ids=lambda options: "-".join(map(str, options.values())))
def test_quartile_gradients_add_up_to_the_trainers_gradient(tiny_float64_model_path, tmp_path, float64_norms, options):
    """For every TRL loss type and option: the quartiles' summed gradients (TRL's `d L / d log pi` and `d L / d H`
    pushed back through TRL's forward) add up to the gradient of the trainer's own `compute_loss(...).backward()`."""
    trainer = make_trainer(tiny_float64_model_path, tmp_path, beta=0.1, epsilon_high=0.28, **options)
    inputs = off_policy_batch(trainer)
    model, params = trainer.model.eval(), [param for param in trainer.model.parameters() if param.requires_grad]
    model.zero_grad()  # the loss of the whole batch in TRL's evaluation branch (no gradient-accumulation factor)
    trainer.compute_loss(model, inputs).backward()
    expected = torch.cat([param.grad.reshape(-1) for param in params])
    model.zero_grad()

    logps, entropies = trl_values(trainer, inputs)
    d_logps, d_entropies = trl_loss_gradients(trainer, inputs, logps, entropies)
    mask = inputs["completion_mask"].bool()
    group, _ = quartiles(inputs["old_per_token_logps"].exp(), mask)
    pairs = [(d_logps * (group == j), d_entropies * (group == j)) for j in range(4)]
    grads = summed_parameter_gradients(trainer, model, inputs, pairs, micro_batch_size=3)
    assert all(grad.norm() > 0 for grad in grads) and expected.norm() > 0
    torch.testing.assert_close(sum(grads), expected, rtol=1e-9, atol=1e-12)

    report = run_token_diagnostics(trainer, inputs, probe_methods=(), micro_batch_size=3)["gradients"]
    assert report["full_grad_norm"] == pytest.approx(float(expected.norm()), rel=1e-9)
    for j, row in enumerate(report["quartiles"]):
        assert row["count"] == int((group == j).sum())
        assert row["summed_grad_norm"] == pytest.approx(float(grads[j].norm()), rel=1e-9)
        assert row["cos_with_full"] == pytest.approx(float(grads[j] @ expected / grads[j].norm() / expected.norm()))


def test_token_weights_are_the_closed_form_of_dapo(tiny_float64_model_path, tmp_path):
    """`w = -N d L / d log pi` of TRL's dapo loss is `ratio * A * 1[not clipped]` plus the bias-corrected k3 KL part
    `-beta * ratio * (k3 + 1 - pi_ref / pi)`, and the report's per-quartile |w| are its means (numpy quartiles)."""
    beta, epsilon_low, epsilon_high = 0.2, 0.2, 0.28
    trainer = make_trainer(tiny_float64_model_path, tmp_path, loss_type="dapo", beta=beta, epsilon_high=epsilon_high)
    inputs = off_policy_batch(trainer, lr=0.1)
    trainer.model.eval()
    logps, entropies = trl_values(trainer, inputs)
    mask = inputs["completion_mask"].bool()
    ratio = torch.exp(logps - inputs["old_per_token_logps"])
    advantages = inputs["advantages"][:, None]
    clipped = ((advantages > 0) & (ratio > 1 + epsilon_high)) | ((advantages < 0) & (ratio < 1 - epsilon_low))
    log_ref_ratio = inputs["ref_per_token_logps"] - logps
    k3 = log_ref_ratio.exp() - log_ref_ratio - 1
    w_no_kl = torch.where(clipped, 0.0, ratio * advantages) * mask
    w = (w_no_kl - beta * ratio * (k3 + 1 - log_ref_ratio.exp())) * mask
    assert clipped[mask].any() and (~clipped & (advantages != 0))[mask].any() and (w != w_no_kl).any()

    num_tokens = int(mask.sum())
    d_logps, _ = trl_loss_gradients(trainer, inputs, logps, entropies)
    torch.testing.assert_close(-num_tokens * d_logps, w, rtol=1e-10, atol=1e-12)
    d_no_kl, _ = trl_loss_gradients(trainer, inputs, logps, entropies, without_kl=True)
    torch.testing.assert_close(-num_tokens * d_no_kl, w_no_kl, rtol=1e-10, atol=1e-12)

    report = run_token_diagnostics(trainer, inputs, summed_gradients=False, probe_methods=())["gradients"]
    group, edges = quartiles(inputs["old_per_token_logps"].exp(), mask)
    np.testing.assert_allclose(report["quartile_edges"], edges, rtol=1e-12)
    for j, row in enumerate(report["quartiles"]):
        assert row["abs_w_mean"] == pytest.approx(float(w[group == j].abs().mean()), rel=1e-9)
        assert row["abs_w_no_kl_mean"] == pytest.approx(float(w_no_kl[group == j].abs().mean()), rel=1e-9)


def test_hidden_state_gradient_norms_match_autograd(tiny_float64_model_path, tmp_path):
    """`||d L / d h_t||` (KL and entropy bonus included) and `||d log pi_t / d h_t||` at the last hidden state, in
    closed form, against autograd of the trainer's own loss and of the log-probabilities."""
    trainer = make_trainer(tiny_float64_model_path, tmp_path, loss_type="grpo", beta=0.1, entropy_coef=0.1)
    inputs = off_policy_batch(trainer)
    model = trainer.model.eval()
    captured = {}

    def keep_hidden_state(module, args, output):
        output.last_hidden_state.retain_grad()
        captured["h"] = output.last_hidden_state

    num_prompt, num_tokens = inputs["prompt_ids"].size(1), inputs["completion_ids"].size(1)
    positions = slice(num_prompt - 1, num_prompt + num_tokens - 1)  # the positions that predict the completion
    with model.model.register_forward_hook(keep_hidden_state):
        trainer.compute_loss(model, inputs).backward()
        loss_grad = captured["h"].grad[:, positions]
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, positions]
        logps = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
        logps.sum().backward()  # h_t reaches log pi_t only: the gradient at t is d log pi_t / d h_t
        unit_grad = captured["h"].grad[:, positions]
    model.zero_grad()

    d_logps, d_entropies = trl_loss_gradients(trainer, inputs, *trl_values(trainer, inputs))
    assert d_entropies.abs().sum() > 0  # the entropy bonus reaches the hidden state too
    norms = hidden_state_gradient_norms(
        logits.detach(), inputs["completion_ids"], model.lm_head.weight, TEMPERATURE, d_logps, d_entropies
    )
    mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(norms["loss"][mask], loss_grad.norm(dim=-1)[mask], rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(norms["unit"][mask], unit_grad.norm(dim=-1)[mask], rtol=1e-9, atol=1e-14)
    pi = logps.detach().exp()
    torch.testing.assert_close(norms["one_minus_p"], 1 - pi, rtol=1e-9, atol=1e-12)


def sgd_step_of_trl_loss(trainer, inputs, lr, active=None):
    """One SGD step of the gradient of TRL's loss by a real backward through TRL's forward (`GRPOTrainer`'s, whatever
    the trainer overrides); with `active`, gradient only through those tokens, as the Lopti trainer isolates a pass."""

    def forward(*args, **kwargs):
        logps, entropies, aux_loss = GRPOTrainer._get_per_token_logps_and_entropies(trainer, *args, **kwargs)
        if active is None:
            return logps, entropies, aux_loss
        return isolate_token_gradients(logps, active), isolate_token_gradients(entropies, active), aux_loss

    params = [param for param in trainer.model.parameters() if param.requires_grad]
    with mock.patch.object(trainer, "_get_per_token_logps_and_entropies", forward):
        grads = torch.autograd.grad(GRPOTrainer._compute_loss(trainer, trainer.model, inputs), params)
    with torch.no_grad():
        for param, grad in zip(params, grads, strict=True):
            param -= lr * grad


def test_probe_moves_probabilities_as_real_updates_do(tiny_float64_model_path, tmp_path, float64_norms):
    """The probe's GRPO, AR and Lopti updates equal SGD steps of TRL's loss (Lopti: the low tokens, then the high
    tokens from the new parameters against the same pi_old), on the trainer's model; it is restored after each."""
    lr, alpha = 2.0, 0.3
    trainer = make_trainer(
        tiny_float64_model_path,
        tmp_path,
        LoptiGRPOTrainer,
        lopti_threshold=None,
        lopti_quantile=0.4,
        advantage_reweighting_alpha=alpha,
    )
    torch.manual_seed(0)
    inputs, _ = sample_generation_batch(trainer, ROWS)
    model = trainer.model.eval()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    report = run_token_diagnostics(
        trainer, inputs, probe_methods=("grpo", "ar", "lopti", "lowest_quartile_only"), lr=lr, micro_batch_size=3
    )
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])
    probe, gradients = report["probe"], report["gradients"]

    mask = inputs["completion_mask"].bool()
    old_logps = inputs.get("old_per_token_logps")  # pi_old: the trainer's, else (on-policy) TRL's forward now
    old_logps = trl_values(trainer, inputs)[0] if old_logps is None else old_logps
    assert probe["eta"] == pytest.approx(float(torch.quantile(old_logps.exp()[mask], 0.4)), rel=1e-9)
    low = (old_logps.exp() < probe["eta"]) & mask
    assert probe["low_token_count"] == int(low.sum()) and 0 < int(low.sum()) < int(mask.sum())
    assert probe["methods"]["lowest_quartile_only"]["update_norm"] == pytest.approx(
        lr * gradients["quartiles"][0]["summed_grad_norm"], rel=1e-9
    )

    on_policy = dict(inputs, old_per_token_logps=old_logps)
    ar_inputs = dict(on_policy, advantages=reweight_advantages(inputs["advantages"], old_logps, alpha))
    updates = {
        "grpo": [(on_policy, None)],
        "ar": [(ar_inputs, None)],
        "lopti": [(on_policy, low), (on_policy, mask & ~low)],
    }
    logps_before = completion_log_probs(model, inputs, TEMPERATURE)
    group, _ = quartiles(old_logps.exp(), mask)
    advantages = inputs["advantages"][:, None].expand_as(mask)
    for method, steps in updates.items():
        for step_inputs, active in steps:
            sgd_step_of_trl_loss(trainer, step_inputs, lr, active)
        delta_logp = completion_log_probs(model, inputs, TEMPERATURE) - logps_before
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(before[name])
        assert delta_logp[mask].abs().min() > 0  # every token moved
        delta_p = logps_before.exp() * torch.expm1(delta_logp)
        for j in range(4):
            for sign, direction in (("positive", 1), ("negative", -1)):
                tokens = (group == j) & (advantages * direction > 0)
                entry = probe["methods"][method]["groups"][f"q{j}"][sign]
                assert entry["count"] == int(tokens.sum())
                if tokens.any():
                    assert entry["mean_delta_prob"] == pytest.approx(float(delta_p[tokens].mean()), rel=1e-6)
                    moved = (delta_logp[tokens] * direction > 0).double().mean()
                    assert entry["share_in_direction"] == pytest.approx(float(moved))
    shift = {method: probe["methods"][method]["groups"]["all"]["positive"]["mean_delta_prob"] for method in updates}
    assert shift["lopti"] != pytest.approx(shift["grpo"], rel=1e-6)  # the high pass starts where the low one ended


def test_callback_logs_during_training_and_leaves_trls_metrics_alone(tiny_model_path, tmp_path):
    """The callback measures the current generation batch of a real `train()` (a LoptiGRPOTrainer with AR and Lopti)
    and logs under `diagnostics/`; what TRL's loss logs during the measurement does not reach the logs."""
    config = LoptiGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        beta=0.1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
    )
    trainer = LoptiGRPOTrainer(
        model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=Dataset.from_list(ROWS * 4)
    )
    callback = TokenDiagnosticsCallback(trainer, every_n_steps=1, summed_gradients=True)
    trainer.add_callback(callback)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "diagnostics/abs_w_mean_q1" in entry]
    assert len(logged) == 2 and all("diagnostics/summed_grad_norm_q4" in entry for entry in logged)
    assert callback.last_report["kl_reference"] == "inputs"
    assert sum(row["count"] for row in callback.last_report["quartiles"]) == callback.last_report["num_tokens"] > 0
    assert not any(key.startswith("eval_") for entry in trainer.state.log_history for key in entry)
    assert all(len(values) == 0 for values in trainer._metrics["eval"].values())  # TRL's eval-branch metrics restored


def puzzle_length_reward(completions, prompts, solution_text_format, **kwargs):
    """The completions' lengths, for K&K rows only (their solutions are required) whose prompts are rendered as
    `trl-lopti grpo` renders them: as text that continues the assistant's "<think>"."""
    assert len(solution_text_format) == len(completions) and all(p.endswith("<think>") for p in prompts), prompts[0]
    return length_reward(completions)


CLI_CASES = [
    *[["--loss_type", loss_type] for loss_type in TRL_LOSS_TYPES],
    # AR (on by default) refuses a KL term with a sequence-level ratio; the diagnostics measure TRL's loss without AR
    ["--loss_type", "grpo", "--importance_sampling_level", "sequence", "--advantage_reweighting_alpha", "0"],
]


@pytest.mark.parametrize("flags", CLI_CASES, ids=lambda flags: "-".join(flags[1::2]))
def test_diagnose_runs_for_every_trl_loss(tiny_model_path, tmp_path, flags):
    """`trl-lopti diagnose` with `trl-lopti grpo`'s options (its default task, generated K&K puzzles, rendered as train
    renders them, and a reward function by import path) measures a batch of 2 prompts x 2 completions for every TRL
    loss; `num_iterations 2` first takes one Adam step on it."""
    argv = [
        "--model_name_or_path",
        tiny_model_path,
        "--kk_num_samples",
        "2",
        "--reward_funcs",
        "test_diagnostics.puzzle_length_reward",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "2",
        "--max_completion_length",
        "4",
        "--beta",
        "0.04",
        "--epsilon_high",
        "0.28",
        "--probe_methods",
        "grpo",
        "lopti",
        "--probe_lr",
        "0.1",
        "--use_cpu",
        "true",
        "--output_dir",
        str(tmp_path),
        *flags,
    ]
    dapo = "dapo" in flags
    argv += ["--num_iterations", "2", "--learning_rate", "1e-2"] if dapo else ["--no_plots"]
    assert diagnose_main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    gradients = report["gradients"]
    assert gradients["loss"]["loss_type"] == flags[1] and report["generation"]["num_completions"] == 4
    assert len(set(report["generation"]["rewards"])) > 1  # the reward named by its import path
    assert sum(row["count"] for row in gradients["quartiles"]) == gradients["num_tokens"] > 0
    assert gradients["kl_reference"] == "inputs" and gradients["full_grad_norm"] is not None
    assert set(report["probe"]["methods"]) == {"grpo", "lopti"}
    assert "| Q1 (lowest) |" in (tmp_path / "report.md").read_text()
    if dapo:
        assert report["inner_steps"]["update_norm"] > 0
        assert (tmp_path / "gradients.png").stat().st_size > 0 and (tmp_path / "probability_shift.png").stat().st_size
    else:
        assert report["inner_steps"] is None and not (tmp_path / "gradients.png").exists()


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--probe_methods", "grpo", "sideways"], "sideways"),
        (["--lopti_threshold", "None"], "probe_methods"),  # the default probes include Lopti's
        (["--num_prompts", "0"], "num_prompts"),
        (["--task", "toy"], "task"),  # trl-lopti grpo's own check
        (["--dry_run"], "dry_run"),
    ],
)
def test_diagnose_refuses_bad_arguments_before_loading(tiny_model_path, run_cli, tmp_path, argv, field):
    base = ["diagnose", "--model_name_or_path", tiny_model_path, "--use_cpu", "true", "--output_dir", str(tmp_path)]
    code, _, err = run_cli(base + argv)
    assert code == 2 and field in err and not (tmp_path / "report.json").exists()


def test_diagnose_needs_a_model(run_cli):
    code, _, err = run_cli(["diagnose", "--use_cpu", "true"])
    assert code == 2 and "model_name_or_path" in err


def test_the_fig3_statistic_by_hand():
    # 2 completions x 5 tokens, the last two of the second one padding: 8 tokens, no quartile edge on a token.
    before = torch.log(torch.tensor([[0.1, 0.2, 0.6, 0.9, 0.35], [0.3, 0.5, 0.8, 0.4, 0.4]], dtype=torch.float64))
    after = torch.log(torch.tensor([[0.2, 0.1, 0.7, 0.9, 0.5], [0.2, 0.6, 0.7, 0.9, 0.9]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    edges, quartile = probability_quartiles(before, mask)
    # pi_old sorted: 0.1 0.2 0.3 0.35 0.5 0.6 0.8 0.9; linear quantiles at positions 1.75, 3.5, 5.25.
    assert edges == pytest.approx([0.275, 0.425, 0.65])
    shift = probability_shift(before, after, torch.tensor([1.5, -0.5]), quartile)

    def counts(sign):
        return [shift[f"q{q}"][sign]["count"] for q in range(4)], [
            shift[f"q{q}"][sign]["in_direction"] for q in range(4)
        ]

    # positive (row 0): 0.1 rose (Q1), 0.2 fell (Q1), 0.35 rose (Q2), 0.6 rose (Q3), 0.9 unchanged (Q4)
    assert counts("positive") == ([2, 1, 1, 1], [1, 1, 1, 0])
    # negative (row 1): 0.3 fell (Q2), 0.5 rose (Q3), 0.8 fell (Q4); padding not counted
    assert counts("negative") == ([0, 1, 1, 1], [0, 1, 0, 1])
    assert shift["all"]["positive"]["count"] == 5 and shift["all"]["negative"]["in_direction"] == 2
    assert shift["q0"]["positive"]["share_in_direction"] == 0.5 and shift["all"]["zero_advantage_count"] == 0
    assert shift["q3"]["negative"]["mean_delta_prob"] == pytest.approx(0.7 - 0.8)
