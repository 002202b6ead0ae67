"""The method comparison (`benchmarks/compare_methods.py`) on its tiny size: report structure and real invariants.

The tiny size trains a random tiny Qwen2 (no hub) with GRPOTrainer, AR, Lopti and AR + Lopti on two seeds. What it
learns is meaningless; what is checked is what the comparison promises: equal generation batches, Lopti's doubled
optimizer steps, identical starting points per seed, Fig.-3 shares that follow from their counts, intervals around
their means, and weights that moved.
"""

import json
import math

import pytest
import torch

from conftest import load_benchmark_script

from trl_lopti.diagnostics import completion_log_probs
from trl_lopti.tasks import arithmetic


pytestmark = pytest.mark.slow  # eight tiny training runs: about 30 s alone on 2 CPUs

METHOD_NAMES = ["grpo", "ar", "lopti", "ar+lopti"]
ROLLOUT_BATCHES = 3


@pytest.fixture(scope="module")
def compare():
    return load_benchmark_script("compare_methods")


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compare")


@pytest.fixture(scope="module")
def report(compare, output_dir):
    return compare.main(
        ["--size", "tiny", "--seeds", "0", "1", "--rollout-batches", str(ROLLOUT_BATCHES), "--threads", "1",
         "--output-dir", str(output_dir)]
    )  # fmt: skip


def runs_by(report, method):
    return sorted((r for r in report["runs"] if r["method"] == method), key=lambda r: r["seed"])


def all_intervals(node):
    """Every `{"mean", "low", "high"}` dict in a nested structure."""
    if isinstance(node, dict):
        if {"mean", "low", "high", "n"} <= set(node):
            yield node
        else:
            for value in node.values():
                yield from all_intervals(value)
    elif isinstance(node, list):
        for value in node:
            yield from all_intervals(value)


def test_outputs_written_and_well_formed(report, output_dir):
    on_disk = json.loads((output_dir / "compare_methods.json").read_text())
    assert on_disk["seeds"] == [0, 1]
    assert on_disk["command"].startswith("python benchmarks/compare_methods.py --size tiny")
    assert list(on_disk["methods"]) == METHOD_NAMES
    assert len(on_disk["runs"]) == 2 * len(METHOD_NAMES)
    for name in METHOD_NAMES:
        assert (output_dir / "compare_methods_runs" / f"{name.replace('+', '_')}_seed0.json").is_file()
    table = (output_dir / "compare_methods.md").read_text()
    tables, current = [], []
    for line in table.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    assert len(tables) == 6  # held-out, paired differences, per family, Fig. 3, Fig. 3 paired, cost
    for rows in tables:
        assert len({row.count("|") for row in rows}) == 1  # every row of a table has the header's columns
    rows = [line for rows in tables for line in rows]
    for name in METHOD_NAMES:
        paired_rows = 0 if name == "grpo" else 1 + 2  # held-out differences, Fig. 3 differences (two signs)
        assert sum(line.startswith(f"| {name} |") for line in rows) == 1 + paired_rows + 1 + 2 + 1
    for png in ("curves", "fig3", "heldout"):
        path = output_dir / f"compare_methods_{png}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_equal_rollouts_and_lopti_doubles_optimizer_steps(report):
    for name in METHOD_NAMES:
        passes = 2 if name in ("lopti", "ar+lopti") else 1
        for run in runs_by(report, name):
            assert run["generation_batches"] == ROLLOUT_BATCHES  # counted by the probe hook
            assert len(run["training_reward"]) == ROLLOUT_BATCHES  # one reward call per generation batch
            assert len(run["fig3_batches"]) == ROLLOUT_BATCHES
            assert run["optimizer_steps"] == passes * ROLLOUT_BATCHES  # counted by on_optimizer_step
            assert run["global_step"] == run["optimizer_steps"]
    assert runs_by(report, "grpo")[0]["trainer"] == "GRPOTrainer"
    assert runs_by(report, "lopti")[0]["trainer"] == "LoptiGRPOTrainer"


def test_same_start_per_seed(report):
    # Same seed => same prompts, same starting weights, same sampling: the first generation batch is identical for
    # every method (it is generated before any update), and so is the "before" evaluation.
    for seed in (0, 1):
        runs = [r for r in report["runs"] if r["seed"] == seed]
        first = {json.dumps(r["fig3_batches"][0]["first_completion_ids"]) for r in runs}
        assert len(first) == 1
        assert len({r["training_reward"][0] for r in runs}) == 1
        assert len({json.dumps(r["before"], sort_keys=True) for r in runs}) == 1
    # Different seeds sample differently.
    grpo = runs_by(report, "grpo")
    assert grpo[0]["fig3_batches"][0]["first_completion_ids"] != grpo[1]["fig3_batches"][0]["first_completion_ids"]


def test_model_changed(report):
    for run in report["runs"]:
        assert run["parameter_distance"] > 1e-4


def test_fig3_counts_consistent_and_shares_follow_from_them(report, compare):
    for run in report["runs"]:
        for batch in run["fig3_batches"]:
            counted = sum(batch[sign]["count"][q] for sign in ("positive", "negative") for q in range(4))
            assert counted + batch["zero_advantage_tokens"] == batch["completion_tokens"]
            for sign in ("positive", "negative"):
                for q in range(4):
                    assert 0 <= batch[sign]["in_direction"][q] + batch[sign]["against"][q] <= batch[sign]["count"][q]
        # The run's shares are the pooled counts, recomputed here independently.
        for sign in ("positive", "negative"):
            for q in range(4):
                count = sum(b[sign]["count"][q] for b in run["fig3_batches"])
                hits = sum(b[sign]["in_direction"][q] for b in run["fig3_batches"])
                share = run["fig3"][sign]["share"][q]
                assert (share is None) == (count == 0)
                if count:
                    assert share == pytest.approx(hits / count)
                    assert 0.0 <= share <= 1.0
    # The tiny run has signal: tokens of both advantage signs were probed.
    pooled = report["methods"]["grpo"]["fig3_pooled"]
    assert pooled["positive"]["all"]["count"] > 0 and pooled["negative"]["all"]["count"] > 0
    for name in METHOD_NAMES:
        pooled = report["methods"][name]["fig3_pooled"]
        for sign in ("positive", "negative"):
            total = sum(b[sign]["in_direction"][q] for r in runs_by(report, name) for b in r["fig3_batches"]
                        for q in range(4))  # fmt: skip
            assert pooled[sign]["all"]["in_direction"] == total


def test_intervals_contain_their_means(report):
    intervals = list(all_intervals(report["methods"]))
    assert len(intervals) > 50
    for stat in intervals:
        if stat["low"] is not None:
            assert stat["low"] <= stat["mean"] <= stat["high"]
    # Paired differences to grpo: zero for grpo itself, and the mean of the per-seed differences for the others.
    grpo = {r["seed"]: r for r in runs_by(report, "grpo")}
    assert report["methods"]["grpo"]["paired_vs_grpo"]["heldout_reward_after"]["mean"] == 0.0
    for name in METHOD_NAMES:
        diffs = [r["after"]["accuracy"] - grpo[r["seed"]]["after"]["accuracy"] for r in runs_by(report, name)]
        paired = report["methods"][name]["paired_vs_grpo"]["heldout_accuracy_after"]
        assert paired["mean"] == pytest.approx(sum(diffs) / len(diffs))
    for name in METHOD_NAMES:
        for q in range(4):
            diffs = [r["fig3"]["negative"]["share"][q] - grpo[r["seed"]]["fig3"]["negative"]["share"][q]
                     for r in runs_by(report, name)
                     if r["fig3"]["negative"]["share"][q] is not None
                     and grpo[r["seed"]]["fig3"]["negative"]["share"][q] is not None]  # fmt: skip
            paired = report["methods"][name]["paired_vs_grpo"][f"fig3_negative_share_q{q + 1}"]
            assert paired["n"] == len(diffs)
            if diffs:
                assert paired["mean"] == pytest.approx(sum(diffs) / len(diffs))
    # The held-out change is after - before, seed by seed.
    for name in METHOD_NAMES:
        runs = runs_by(report, name)
        changes = [r["after"]["reward"] - r["before"]["reward"] for r in runs]
        assert report["methods"][name]["heldout_reward_change"]["mean"] == pytest.approx(sum(changes) / len(changes))


def test_resume_reuses_finished_runs(compare, output_dir, report, capsys):
    again = compare.main(
        ["--size", "tiny", "--seeds", "0", "1", "--rollout-batches", str(ROLLOUT_BATCHES), "--threads", "1",
         "--output-dir", str(output_dir)]
    )  # fmt: skip
    assert capsys.readouterr().out.count("reusing") == 2 * len(METHOD_NAMES)
    assert [r["parameter_distance"] for r in again["runs"]] == [r["parameter_distance"] for r in report["runs"]]


def test_t_interval_against_hand_computation(compare):
    stat = compare.t_interval([1.0, 2.0, 3.0])
    # sd = 1, t_{0.975, 2} = 4.302653, half width = 4.302653 / sqrt(3)
    assert stat["mean"] == pytest.approx(2.0)
    assert stat["high"] - stat["mean"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)
    assert compare.t_interval([0.5])["low"] is None


def test_shift_counts_by_hand(compare):
    # 2 completions x 5 tokens; the last two tokens of the second one are padding. 8 tokens, so that no quartile edge
    # falls on a token's probability.
    before = torch.log(torch.tensor([[0.1, 0.2, 0.6, 0.9, 0.35], [0.3, 0.5, 0.8, 0.4, 0.4]]))
    after = torch.log(torch.tensor([[0.2, 0.1, 0.7, 0.9, 0.5], [0.2, 0.6, 0.7, 0.9, 0.9]]))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    counts = compare.shift_counts(before, after, torch.tensor([1.5, -0.5]), mask)
    # pi_old, sorted: 0.1 0.2 0.3 0.35 0.5 0.6 0.8 0.9; linear quantiles at positions 1.75, 3.5, 5.25.
    assert counts["edges"] == pytest.approx([0.275, 0.425, 0.65])
    # positive (row 0): 0.1 rose (Q1), 0.2 fell (Q1), 0.35 rose (Q2), 0.6 rose (Q3), 0.9 unchanged (Q4).
    assert counts["positive"]["count"] == [2, 1, 1, 1]
    assert counts["positive"]["in_direction"] == [1, 1, 1, 0]
    assert counts["positive"]["against"] == [1, 0, 0, 0]
    assert counts["positive"]["sum_delta_prob"] == pytest.approx([0.0, 0.15, 0.1, 0.0], abs=1e-6)
    # negative (row 1): 0.3 fell (Q2), 0.5 rose (Q3), 0.8 fell (Q4); the padding is not counted.
    assert counts["negative"]["count"] == [0, 1, 1, 1]
    assert counts["negative"]["in_direction"] == [0, 1, 0, 1]
    assert counts["negative"]["against"] == [0, 0, 1, 0]
    assert counts["zero_advantage_tokens"] == 0


def test_bad_settings_name_the_field(compare):
    with pytest.raises(ValueError, match="num_eval_per_family"):
        compare.CompareArguments(task="sub", num_eval_per_family=55)
    with pytest.raises(ValueError, match="methods"):
        compare.CompareArguments(methods=["grpo", "ppo"])
    with pytest.raises(ValueError, match="rollout_batches"):
        compare.CompareArguments(rollout_batches=0)


def test_probe_rescores_after_the_last_optimizer_step(compare, tmp_path):
    # One generation batch of Lopti (two optimizer steps): the probe's "after" log-probabilities are those of the final
    # weights (after both passes), its "before" ones those of the starting weights.
    from transformers import AutoTokenizer
    from trl_lopti import LoptiGRPOConfig
    from trl_lopti.models import build_tiny_model

    model_path = build_tiny_model(tmp_path / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train, _ = arithmetic.split_problems("add", 2)
    dataset = arithmetic.build_train_dataset(train, 2, seed=0)
    _, ProbedLoptiGRPOTrainer = compare.make_probed_trainer_classes()
    config = LoptiGRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", max_steps=2, learning_rate=1e-2,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=4, save_strategy="no",
        lopti_threshold=0.5, advantage_reweighting_alpha=0.3, seed=0,
    )  # fmt: skip
    trainer = ProbedLoptiGRPOTrainer(model=model_path, reward_funcs=arithmetic.digit_share_reward, args=config,
                                     train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.generation_batches == 1
    assert trainer.probe_last_scores is None and trainer.probe_batches == []  # re-scored only when asked
    trainer.finish_probe()
    batch, logps_after = trainer.probe_last_scores
    final = completion_log_probs(trainer.model, batch, temperature=1.0).cpu()
    torch.testing.assert_close(logps_after, final)
    mask = batch["completion_mask"].bool()
    assert (batch["logps_before"] - logps_after)[mask].abs().max() > 1e-4  # the weights moved in between
    assert len(trainer.probe_batches) == 1
