"""The cost benchmark (`benchmarks/bench_lopti.py`) on its tiny size: a well-formed report and counted invariants.

Timings on a shared CPU are noise; only counted quantities (passes, steps, tokens) and the report's structure are
checked, never a speed.
"""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from conftest import load_benchmark_script


pytestmark = pytest.mark.slow  # trains five tiny trainers (about 15 s alone on 2 CPUs, under a minute when shared)

VARIANTS = ["grpo", "ar", "lopti", "ar+lopti", "lopti-refstyle", "lopti-quantile"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark_script("bench_lopti")


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    # The tiny size with a single generation batch per variant: the test checks structure and counts, not speed.
    size = dataclasses.replace(bench.SIZES["tiny"], warmup_batches=0, measured_batches=1)
    output_dir = tmp_path_factory.mktemp("bench")
    return bench.run_benchmark(size, output_dir, variants=VARIANTS, command="pytest")


def by_name(report) -> dict:
    return {result["name"]: result for result in report["results"]}


def test_files_written_and_well_formed(report):
    json_path, markdown_path = Path(report["json_path"]), Path(report["markdown_path"])
    on_disk = json.loads(json_path.read_text())
    assert [r["name"] for r in on_disk["results"]] == VARIANTS
    assert on_disk["skipped"] == []
    table = markdown_path.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 * (1 + len(VARIANTS))  # wall-clock and CPU-time tables: header + one row per variant
    assert all(line.count("|") == rows[0].count("|") for line in rows)
    for name in VARIANTS:
        assert f"| {name}: " in table


def test_every_measurement_is_present_and_finite(report, bench):
    size = report["size"]
    for result in report["results"]:
        assert len(result["batches"]) == size["warmup_batches"] + size["measured_batches"]
        assert sum(not b["warmup"] for b in result["batches"]) == size["measured_batches"]
        for median in ("median", "median_cpu"):
            for key in ("step_s", "generation_s", "scoring_s", "loss_backward_optimizer_s", "completion_tokens_per_s"):
                value = result[median][key]
                assert math.isfinite(value) and value > 0, (result["name"], median, key, value)
        # The parts of a step fit inside its time, on both clocks.
        for batch in result["batches"]:
            for clock in ("wall", "cpu"):
                times = batch[clock]
                parts = times["generation_s"] + times["scoring_s"] + times["loss_backward_optimizer_s"]
                assert parts <= times["step_s"] * 1.001 + 1e-3, (result["name"], clock, times)
                assert times["reward_s"] <= times["scoring_s"] + 1e-3
                assert times["backward_s"] <= times["train_s"] + 1e-3
        assert bench.peak_memory_mb(result) > 0
        assert result["memory"]["peak_rss_mb"] >= result["memory"]["baseline_rss_mb"]
        if result["name"] == "grpo":
            assert result["ratios"]["step_s"] == pytest.approx(1.0)
            assert result["ratios_cpu"]["step_s"] == pytest.approx(1.0)
        assert set(result["ratios"]) >= {"step_s", "loss_backward_optimizer_s", "peak_memory", "policy_forwards_grad"}
        assert set(result["ratios_cpu"]) >= {"step_s", "loss_backward_optimizer_s"}


def test_same_workload_for_every_variant(report):
    size = report["size"]
    completions = size["prompts_per_batch"] * size["num_generations"]
    for result in report["results"]:
        for batch in result["batches"]:
            assert batch["generate_calls"] == 1
            assert batch["completions"] == completions
            assert batch["completion_tokens"] == completions * size["max_completion_length"]  # fixed length
    prompt_tokens = {tuple(b["prompt_tokens"] for b in r["batches"]) for r in report["results"]}
    assert len(prompt_tokens) == 1  # the same prompts, batch by batch


def test_counted_passes(report):
    results = by_name(report)
    size = report["size"]
    grpo = results["grpo"]["counts_per_batch"]
    micro_steps = size["gradient_accumulation_steps"]  # steps_per_generation * num_iterations (1)
    # GRPO, on-policy: one forward+backward per micro-batch, no extra forward, one optimizer step.
    assert grpo["policy_forwards_grad"] == micro_steps
    assert grpo["policy_forwards_no_grad"] == 0
    assert grpo["backward_passes"] == micro_steps
    assert grpo["optimizer_steps"] == 1
    assert grpo["ref_forwards"] == 0
    # AR: no pass of its own.
    for key in ("policy_forwards_grad", "policy_forwards_no_grad", "backward_passes", "optimizer_steps"):
        assert results["ar"]["counts_per_batch"][key] == grpo[key], key
    # Lopti: exactly twice GRPO's gradient passes and optimizer steps, and no forward beyond them.
    for name in ("lopti", "ar+lopti"):
        counts = results[name]["counts_per_batch"]
        assert counts["policy_forwards_grad"] == 2 * grpo["policy_forwards_grad"], name
        assert counts["backward_passes"] == 2 * grpo["backward_passes"], name
        assert counts["optimizer_steps"] == 2 * grpo["optimizer_steps"], name
        assert counts["policy_forwards_no_grad"] == 0, name
        assert results[name]["ratios"]["policy_forwards_grad"] == 2.0
        share = results[name]["logged"]["lopti/low_token_share"]
        assert 0.0 < share < 1.0  # both passes had active tokens (none was skipped)
    # The reference-style emulation spends one no-grad forward per micro-batch on old log-probabilities.
    refstyle = results["lopti-refstyle"]["counts_per_batch"]
    assert refstyle["policy_forwards_no_grad"] == micro_steps
    assert refstyle["policy_forwards_grad"] == 2 * grpo["policy_forwards_grad"]
    # The quantile split needs pi_old of the whole batch first: one no-grad forward over it (micro-batch chunks).
    quantile = results["lopti-quantile"]["counts_per_batch"]
    assert quantile["policy_forwards_no_grad"] == micro_steps
    assert quantile["policy_forwards_grad"] == 2 * grpo["policy_forwards_grad"]
    # Generation forwards are counted apart from training forwards, and equal for all variants.
    assert len({r["counts_per_batch"]["generation_forwards"] for r in report["results"]}) == 1
    assert grpo["generation_forwards"] >= 1


def test_own_code_timed_only_for_lopti_trainer(report):
    results = by_name(report)
    assert results["grpo"]["median"]["own_code_s"] == 0.0
    for name in ("ar", "lopti", "ar+lopti", "lopti-refstyle", "lopti-quantile"):
        assert results[name]["median"]["own_code_s"] > 0.0, name
        assert results[name]["median"]["own_code_s"] <= results[name]["median"]["train_s"]


def test_merge_pools_batches(bench, report):
    merged = bench.merge_reports([report, report])
    assert len(merged["merged_from"]) == 2
    for result, original in zip(merged["results"], report["results"], strict=True):
        assert result["measured_batches"] == 2 * original["measured_batches"]
        assert result["median"]["step_s"] == pytest.approx(original["median"]["step_s"])
        assert result["counts_per_batch"] == original["counts_per_batch"]
    assert "pooled from 2 runs" in bench.markdown_table(merged)


def test_markdown_table_from_report(bench, report):
    table = bench.markdown_table(report)
    headers = [line for line in table.splitlines() if line.startswith("| configuration | step (s) |")]
    assert len(headers) == 2  # wall-clock and, on CPU, process CPU time
    assert "low-token share" in table


def test_random_model_of_a_given_shape(tmp_path):
    """`build_tiny_model`'s config overrides (what the benchmark's random Qwen2 sizes use): the shape is the one asked
    for, and a vocabulary smaller than the tokenizer's is raised to it."""
    from transformers import AutoConfig, AutoTokenizer

    from trl_lopti.models import build_tiny_model

    path = build_tiny_model(tmp_path / "wide", hidden_size=48, num_hidden_layers=3, intermediate_size=100,
                            vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=4096)  # fmt: skip
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size,
            config.tie_word_embeddings, config.max_position_embeddings) == (48, 3, 100, 1024, True, 4096)  # fmt: skip
    small = AutoConfig.from_pretrained(build_tiny_model(tmp_path / "small", vocab_size=10))
    assert small.vocab_size == len(AutoTokenizer.from_pretrained(path)) > 10
