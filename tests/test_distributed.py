"""Lopti under 2-process DDP on CPU (gloo): every pass is an ordinary, synchronised optimizer step, and DDP trains
the same model as one process on the same completions."""

import json

import pytest
from testing_utils import torchrun


@pytest.mark.slow
@pytest.mark.parametrize("advantage_estimator", ["grpo", "reinforce_plus_plus"])
def test_two_process_ddp_keeps_ranks_identical_after_each_pass(tiny_model_path, tmp_path, advantage_estimator):
    result_path = tmp_path / "result.json"
    torchrun("ddp_lopti_script.py", 2, tiny_model_path, str(tmp_path / "out"), str(result_path), advantage_estimator)
    result = json.loads(result_path.read_text())
    assert result["world_size"] == 2 and "MULTI_CPU" in result["distributed_type"]
    assert [record["step"] for record in result["steps"]] == [1, 2, 3, 4]
    # the ranks trained on different completions, yet hold identical parameters after every optimizer step,
    # the low pass (steps 1, 3) included: its gradients were all-reduced
    assert all(record["ranks_saw_different_completions"] for record in result["steps"])
    assert all(record["ranks_equal"] for record in result["steps"])
    assert result["final_ranks_equal"] and result["model_changed"]
    assert len(result["low_pass_losses"]) == 2 and len(result["high_pass_losses"]) == 2
    # both generation batches were split (threshold chosen from the tokens of both processes)
    assert len(result["thresholds"]) == 2 and all(0.0 < share < 1.0 for share in result["low_token_shares"])
    if advantage_estimator == "reinforce_plus_plus":
        assert_reinforce_plus_plus_whitens_over_both_processes(result["per_rank_batches"])


def assert_reinforce_plus_plus_whitens_over_both_processes(per_rank_batches):
    """Each rank's advantages are its slice of the whitening over the tokens of both ranks (not of its own)."""
    import numpy as np

    assert len(per_rank_batches) == 2 and len(per_rank_batches[0]) == len(per_rank_batches[1]) == 2
    for rank0, rank1 in zip(*per_rank_batches, strict=True):
        rewards = np.array(rank0["rewards"] + rank1["rewards"])
        lengths = np.array(rank0["lengths"] + rank1["lengths"])
        token_returns = np.repeat(rewards, lengths)
        assert token_returns.std() > 0, "degenerate batch: all rewards equal"
        expected = (rewards - token_returns.mean()) / np.sqrt(token_returns.var(ddof=1) + 1e-8)
        np.testing.assert_allclose(rank0["advantages"] + rank1["advantages"], expected, rtol=1e-5, atol=1e-6)
        local_returns = np.repeat(rank0["rewards"], rank0["lengths"])
        local = (np.array(rank0["rewards"]) - local_returns.mean()) / np.sqrt(local_returns.var(ddof=1) + 1e-8)
        assert not np.allclose(rank0["advantages"], local, atol=1e-4), "whitened over one process only"


@pytest.mark.slow
def test_two_process_ddp_equals_one_process_with_twice_the_batch(tiny_float64_model_path, tmp_path):
    """A Lopti cycle (sequence-level ratio, AR in its general form) on a fixed generation batch split over 2 gloo
    processes, float64; and under 2 processes a user's loss whose side forward of a frozen anchor model, without
    gradient, comes first (`testing_utils.anchor_metric_trainer`): it changes nothing."""
    import torch
    from testing_utils import assert_parameters_close
    from transformers import AutoModelForCausalLM

    results = {}
    for num_processes, loss in ((1, "trl"), (2, "trl"), (2, "anchor")):
        path = tmp_path / f"parameters_{num_processes}_{loss}.pt"
        output_dir = str(tmp_path / f"out{num_processes}_{loss}")
        torchrun("ddp_equivalence_script.py", num_processes, tiny_float64_model_path, output_dir, str(path), loss)
        results[(num_processes, loss)] = torch.load(path)
    assert [results[key]["world_size"] for key in results] == [1, 2, 2]
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_float64_model_path).named_parameters())
    single = results[(1, "trl")]["parameters"]
    assert all(parameter.dtype == torch.float64 for parameter in single.values())
    for key in ((2, "trl"), (2, "anchor")):
        largest_difference, moved = assert_parameters_close(results[key]["parameters"], single, initial, atol=1e-8)
        # the measured figure, for the record (pytest -s)
        print(f"{key}: largest difference from 1 process {largest_difference:.3g}, moved {moved:.3g} in all")  # noqa: T201
        assert moved > 1e-3, "the cycle must move the parameters"
