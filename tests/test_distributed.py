"""Lopti under 2-process DDP on CPU (gloo): every pass is an ordinary, synchronised optimizer step."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_process_ddp_keeps_ranks_identical_after_each_pass(tiny_model_path, tmp_path):
    result_path = tmp_path / "result.json"
    script = Path(__file__).with_name("ddp_lopti_script.py")
    environment = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(script), tiny_model_path, str(tmp_path / "out"), str(result_path),
    ]
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(result_path.read_text())
    assert result["world_size"] == 2 and "MULTI_CPU" in result["distributed_type"]
    assert [record["step"] for record in result["steps"]] == [1, 2, 3, 4]
    # the ranks trained on different completions, yet hold identical parameters after every optimizer step,
    # the low pass (steps 1, 3) included: its gradients were all-reduced
    assert all(record["ranks_saw_different_completions"] for record in result["steps"])
    assert all(record["ranks_equal"] for record in result["steps"])
    assert result["final_ranks_equal"] and result["model_changed"]
    assert len(result["low_pass_losses"]) == 2 and len(result["high_pass_losses"]) == 2
