"""The benchmarks (`benchmarks/experiments.py` on the harness) at their tiny sizes: counted passes, complete files, and
the comparison's statistics against scipy.

Timings on a shared CPU are noise: only what is counted and written is checked, never a speed.
"""

import json
import math

import pytest
from scipy import stats
from testing_utils import load_benchmark_script


pytestmark = pytest.mark.slow  # trains 14 tiny trainers and a tiny comparison (about 2 minutes on 2 shared CPUs)

VARIANTS = ["grpo", "ar", "lopti", "ar+lopti", "lopti-quantile"]
LOPTI = {"lopti", "ar+lopti", "lopti-quantile"}


@pytest.fixture(scope="module")
def benchmarks():
    for name in ("harness", "report"):  # experiments.py imports them by name
        load_benchmark_script(name)
    return load_benchmark_script("experiments")


@pytest.fixture(scope="module")
def cost(benchmarks, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("cost")
    options = dict(size="tiny", variants=VARIANTS, warmup_batches=1, measured_batches=1)
    benchmarks.cost(benchmarks.Cost(output_dir=str(output_dir), **options))
    return json.loads((output_dir / "bench_tiny.json").read_text()), output_dir


@pytest.fixture(scope="module")
def comparison(benchmarks, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("compare")
    benchmarks.compare(
        benchmarks.Compare(size="tiny", methods=["grpo", "lopti"], seeds=[0, 1], output_dir=str(output_dir))
    )
    return json.loads((output_dir / "compare_tiny.json").read_text()), output_dir


def test_counted_passes_per_generation_batch(cost):
    data, _ = cost
    size = data["size"]
    micro_steps = size["gradient_accumulation_steps"]  # = steps_per_generation: one GRPO optimizer step per batch
    completions = size["prompts_per_batch"] * size["num_generations"]
    runs = {run["name"]: run for run in data["runs"]}
    for name, run in runs.items():
        passes = 2 if name in LOPTI else 1
        # Lopti: TRL's no-grad pi_old forward over the generation batch, in micro-batches (the batch spans both passes'
        # optimizer steps); on-policy AR alone takes pi_old from its loss forward
        extra = completions // size["per_device_train_batch_size"] if name in LOPTI else 0
        assert run["global_step"] == passes * len(run["batches"]), name
        for batch in run["batches"]:
            assert batch["policy_forwards_grad"] == passes * micro_steps, name
            assert batch["policy_forwards_no_grad"] == extra, name
            assert batch["backward_passes"] == passes * micro_steps, name
            assert batch["optimizer_steps"] == passes, name
            assert batch["generate_calls"] == 1, name
            assert batch["completions"] == completions
            assert batch["completion_tokens"] == completions * size["max_completion_length"]  # fixed length
    # The same prompts batch by batch, and decoding forwards counted apart, equal for all.
    assert len({tuple(b["prompt_tokens"] for b in run["batches"]) for run in runs.values()}) == 1
    assert len({tuple(b["generation_forwards"] for b in run["batches"]) for run in runs.values()}) == 1
    assert runs["grpo"]["batches"][0]["generation_forwards"] >= size["max_completion_length"]


def test_json_and_markdown_complete(cost):
    data, output_dir = cost
    assert [run["name"] for run in data["runs"]] == VARIANTS and data["skipped"] == []
    for run in data["runs"]:
        assert len(run["batches"]) == 2 and [b["warmup"] for b in run["batches"]] == [True, False]
        assert run["medians"]["measured_batches"] == 1 and run["peak_memory_mb"] > 0
        for batch in run["batches"]:
            for clock in ("wall", "cpu"):
                times = batch[clock]
                assert all(math.isfinite(v) and v >= 0 for v in times.values()), (run["name"], times)
                parts = times["generation_s"] + times["scoring_s"] + times["loss_backward_optimizer_s"]
                assert 0 < parts <= times["step_s"] * 1.001 + 1e-3, (run["name"], clock, times)
            logged = batch["logged"]
            assert len(logged["reward"]) == 1  # TRL logs a batch's reward once, at its first optimizer step
            if run["name"] == "grpo":
                assert not any(key.startswith("lopti/") for key in logged)
            if run["name"] == "ar":  # the AR weight alpha * pi_old + 1 - alpha lies in [1 - alpha, 1]
                assert 0.8 <= logged["lopti/ar_weight_mean"][0] < 1.0  # < 1: AR reweighted (1 without it)
            if run["name"] in LOPTI:  # both passes had active tokens, and each logged its loss once
                assert 0.0 < logged["lopti/low_token_share"][0] < 1.0
                assert len(logged["lopti/loss_low_pass"]) == len(logged["lopti/loss_high_pass"]) == 1
    tables = [line for line in (output_dir / "bench_tiny.md").read_text().splitlines() if line.startswith("| ")]
    # wall-clock and CPU time: header and one row per variant; over the base: header and one row per Lopti variant
    assert len(tables) == 2 * (1 + len(VARIANTS)) + len(VARIANTS)
    for name in VARIANTS:
        assert sum(line.startswith(f"| {name}: ") for line in tables) == 2
    # Over GRPO: no forward beyond the passes, except Lopti's no-grad pi_old forward, TRL's own.
    over_base = {line.split(" | ")[0]: line.split(" | ") for line in tables if " / grpo | " in line}
    assert list(over_base) == [f"| {name} / grpo" for name in VARIANTS[1:]]
    for name in VARIANTS[1:]:
        extra = "+2" if name in LOPTI else "none"
        assert over_base[f"| {name} / grpo"][7] == extra, name


def test_comparison_counts_and_pairing(comparison):
    data, output_dir = comparison
    for run in data["runs"]:
        passes = 2 if run["name"] == "lopti" else 1
        assert run["generation_batches"] == len(run["fig3_batches"]) == len(run["training_reward"]) == 2
        assert run["optimizer_steps"] == run["global_step"] == passes * 2
        for batch, fig3 in zip(run["batches"], run["fig3_batches"], strict=True):  # every completion token is counted
            counted = sum(fig3[f"q{q}"][sign]["count"] for sign in ("positive", "negative") for q in range(4))
            assert counted + fig3["all"]["zero_advantage_count"] == batch["completion_tokens"]  # once: sign, quartile
    # Same seed: the same first generation batch (before any update) and the same starting evaluation.
    for seed in (0, 1):
        runs = [run for run in data["runs"] if run["seed"] == seed]
        assert len({run["training_reward"][0] for run in runs}) == 1
        assert len({json.dumps(run["before"], sort_keys=True) for run in runs}) == 1
    grpo = {run["seed"]: run for run in data["runs"] if run["name"] == "grpo"}
    differences = [
        run["after"]["accuracy"] - grpo[run["seed"]]["after"]["accuracy"]
        for run in data["runs"]
        if run["name"] == "lopti"
    ]
    assert data["summary"]["lopti"]["paired"]["heldout_accuracy_after"]["mean"] == pytest.approx(sum(differences) / 2)
    for suffix in ("md", "png"):
        assert (output_dir / f"compare_tiny.{suffix}").stat().st_size > 0


def test_statistics_against_scipy(benchmarks):
    report = benchmarks.report
    values = [0.61, 0.55, 0.72, 0.58, 0.66]
    stat = report.t_interval(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=sum(values) / 5, scale=stats.sem(values))
    assert (stat["low"], stat["high"]) == pytest.approx((low, high), rel=1e-12)
    assert report.t_interval([0.5]) == {"mean": 0.5, "low": None, "high": None, "sd": None, "n": 1}
    equal = report.t_interval([0.4, None, 0.4, float("nan")])  # None and NaN dropped; equal values: zero width
    assert (equal["low"], equal["mean"], equal["high"], equal["n"]) == (0.4, 0.4, 0.4, 2)
    # Paired by seed: seed 4 has no baseline and seed 3 no value; the others pair up.
    method = {0: 0.70, 1: 0.52, 2: 0.75, 3: None, 4: 0.9}
    baseline = {0: 0.61, 1: 0.55, 2: 0.72, 3: 0.58}
    paired = report.paired_difference(method, baseline)
    expected = stats.ttest_rel([0.70, 0.52, 0.75], [0.61, 0.55, 0.72]).confidence_interval(0.95)
    assert paired["n"] == 3
    assert (paired["low"], paired["high"]) == pytest.approx((expected.low, expected.high), rel=1e-12)


RLOO_VARIANTS = ["rloo", "rloo-ar", "rloo-lopti", "rloo-ar+lopti"]


@pytest.fixture(scope="module")
def rloo_cost(benchmarks, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("cost-rloo")
    options = dict(size="tiny", variants=RLOO_VARIANTS, warmup_batches=1, measured_batches=1)
    benchmarks.cost(benchmarks.Cost(output_dir=str(output_dir), **options))
    return json.loads((output_dir / "bench_tiny.json").read_text()), output_dir


def test_rloo_rows_count_rloos_own_old_forward_and_lopti_adds_only_its_second_pass(rloo_cost):
    data, output_dir = rloo_cost
    size, runs = data["size"], {run["name"]: run for run in data["runs"]}
    micro_steps = size["gradient_accumulation_steps"]
    completions = size["prompts_per_batch"] * size["num_generations"]
    assert list(runs) == RLOO_VARIANTS
    assert runs["rloo"]["trainer"] == "RLOOTrainer" and runs["rloo"]["method"] == "RLOO"
    for name, run in runs.items():
        assert run["baseline"] == "rloo"
        assert run["trainer"] == ("RLOOTrainer" if name == "rloo" else "LoptiRLOOTrainer"), name
        passes = 2 if "lopti" in name else 1
        assert run["global_step"] == passes * len(run["batches"]), name
        for batch in run["batches"]:
            assert batch["policy_forwards_grad"] == batch["backward_passes"] == passes * micro_steps, name
            # RLOO's pi_old forward at every generation, in micro-batches; AR and Lopti add none
            assert batch["policy_forwards_no_grad"] == completions // size["per_device_train_batch_size"], name
            assert batch["optimizer_steps"] == passes and batch["generate_calls"] == 1, name
            logged = batch["logged"]
            if "lopti" in name:
                assert 0.0 < logged["lopti/low_token_share"][0] < 1.0
                assert len(logged["lopti/loss_low_pass"]) == len(logged["lopti/loss_high_pass"]) == 1
            if name in ("rloo-ar", "rloo-ar+lopti"):  # alpha * pi_old + 1 - alpha, below 1: AR reweighted
                assert 0.7 <= logged["lopti/ar_weight_mean"][0] < 1.0
    # the ratios of the RLOO rows are to RLOO's (plain RLOO's row has none)
    lines = (output_dir / "bench_tiny.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| rloo") and " / rloo | " not in line]
    assert len(rows) == 2 * len(RLOO_VARIANTS) and all(
        ("x)" in row) == (not row.startswith("| rloo: ")) for row in rows
    )
    # over RLOO: its own no-grad forward, and none added
    over_base = [line.split(" | ") for line in lines if " / rloo | " in line]
    assert [row[0] for row in over_base] == [f"| {name} / rloo" for name in RLOO_VARIANTS[1:]]
    assert all(row[6:8] == ["2 vs 2", "none"] for row in over_base)


GMPO_VARIANTS = ["gmpo", "gmpo-ar", "gmpo-lopti", "gmpo-ar+lopti"]


@pytest.fixture(scope="module")
def gmpo_cost(benchmarks, tmp_path_factory):
    if "gmpo" in benchmarks.harness.UNAVAILABLE:
        pytest.skip(benchmarks.harness.UNAVAILABLE["gmpo"])
    output_dir = tmp_path_factory.mktemp("cost-gmpo")
    options = dict(size="tiny", variants=GMPO_VARIANTS, warmup_batches=1, measured_batches=1)
    benchmarks.cost(benchmarks.Cost(output_dir=str(output_dir), **options))
    return json.loads((output_dir / "bench_tiny.json").read_text())


def test_lopti_on_gmpo_costs_over_gmpo_what_lopti_costs_over_grpo(benchmarks, gmpo_cost, cost):
    size, runs = gmpo_cost["size"], {run["name"]: run for run in gmpo_cost["runs"]}
    grpo_runs = {run["name"]: run for run in cost[0]["runs"]}
    micro_steps = size["gradient_accumulation_steps"]
    assert list(runs) == GMPO_VARIANTS and gmpo_cost["skipped"] == []
    assert runs["gmpo"]["trainer"] == "GMPOTrainer" and runs["gmpo"]["method"] == "GMPO"
    counted = ("policy_forwards_grad", "policy_forwards_no_grad", "backward_passes", "optimizer_steps")
    for name, run in runs.items():
        # the Lopti trainer composed with GMPOTrainer as a user writes it, each run's ratios to GMPO's
        assert run["baseline"] == "gmpo" and run["method"].startswith("GMPO"), name
        assert run["trainer"] == ("GMPOTrainer" if name == "gmpo" else "LoptiGMPOTrainer"), name
        passes = 2 if "lopti" in name else 1
        assert run["global_step"] == passes * len(run["batches"]), name
        for batch in run["batches"]:
            # one gradient forward and backward per micro-batch per pass; no forward without gradient on-policy (GMPO
            # and AR read pi_old from the loss forward), but TRL's pi_old forward under Lopti
            assert batch["policy_forwards_grad"] == batch["backward_passes"] == passes * micro_steps, name
            pi_old_forwards = (
                size["prompts_per_batch"] * size["num_generations"] // size["per_device_train_batch_size"]
            )
            assert batch["policy_forwards_no_grad"] == (pi_old_forwards if passes == 2 else 0), name
            assert batch["optimizer_steps"] == passes and batch["generate_calls"] == 1, name
            logged = batch["logged"]
            if "lopti" in name:  # both passes trained tokens
                assert 0.0 < logged["lopti/low_token_share"][0] < 1.0
                assert len(logged["lopti/loss_low_pass"]) == len(logged["lopti/loss_high_pass"]) == 1
            if name in ("gmpo-ar", "gmpo-ar+lopti"):  # AR's general form reweighted
                assert 0.7 <= logged["lopti/ar_weight_mean"][0] < 1.0
        # the same passes over GMPO as the same settings on GRPO over GRPO: every count of every batch
        grpo_twin = grpo_runs["grpo" if name == "gmpo" else name.removeprefix("gmpo-")]
        assert [[b[key] for key in counted] for b in run["batches"]] == [
            [b[key] for key in counted] for b in grpo_twin["batches"]
        ], name
    # In one report, each row over its own base, the GMPO row of a setting beside its GRPO row.
    merged = {**cost[0], "runs": [*cost[0]["runs"], *gmpo_cost["runs"]]}
    lines = benchmarks.report.cost_markdown(merged).splitlines()
    rows = {
        line.split(" | ")[0].removeprefix("| "): line.split(" | ")
        for line in lines
        if " / grpo | " in line or " / gmpo | " in line
    }
    names = list(rows)
    for setting, passes in (("ar", 1), ("lopti", 2), ("ar+lopti", 2)):
        grpo_row, gmpo_row = f"{setting} / grpo", f"gmpo-{setting} / gmpo"
        assert names[names.index(grpo_row) + 1] == gmpo_row
        # fwd grad, fwd no-grad, extra forwards, bwd (after the run and four time ratios)
        expected = [
            f"{2 * passes} vs 2",
            f"{2 * passes - 2} vs 0",
            "+2" if passes == 2 else "none",
            f"{2 * passes} vs 2",
        ]
        assert rows[grpo_row][5:9] == rows[gmpo_row][5:9] == expected, setting


def test_cost_skips_an_algorithm_this_trl_lacks(benchmarks, tmp_path, monkeypatch):
    monkeypatch.setitem(benchmarks.harness.UNAVAILABLE, "gmpo", "no trl.experimental.gmpo here")
    options = dict(size="tiny", variants=["gmpo", "gmpo-lopti"], warmup_batches=1, measured_batches=1)
    benchmarks.cost(benchmarks.Cost(output_dir=str(tmp_path), **options))
    data = json.loads((tmp_path / "bench_tiny.json").read_text())
    assert data["runs"] == []
    assert data["skipped"] == ["gmpo (no trl.experimental.gmpo here)", "gmpo-lopti (no trl.experimental.gmpo here)"]
    assert "Skipped: gmpo (no trl.experimental.gmpo here)" in (tmp_path / "bench_tiny.md").read_text()
