"""TRL's vLLM modes on a machine without CUDA: vLLM's weight transfer over gloo instead of NCCL.

TRL 1.16 sends the trainer's weights to `vllm serve --weight-transfer-config '{"backend": "nccl"}'` through
vLLM's NCCL weight-transfer engine. Everything of it stays TRL's and vLLM's own: TRL's `VLLMClient`, the
server and its HTTP API, the engine, its rendezvous on a TCPStore and its packed broadcast. Only the
transport changes: the communicator both sides get from `nccl_common.stateless_init_process_group` is a
`GlooCommunicator`, and the two CUDA-only calls of the transfer helpers answer for the CPU. vLLM's CPU layers
also compute with torch on their own weights, which follow an update, instead of kernels that prepack the
weights at load (`VLLM_FACTS["prepacking"]`).

- Trainer process (also in colocate mode, with vLLM inside it): `install_trainer_side()` before the trainer
  is built.
- Server: TRL's `vllm serve` command plus `--worker-extension-cls` naming `WORKER_EXTENSION`, whose import in
  vLLM's worker process installs the server side before the model loads (`vllm_server.cpu_server` runs one).

Nothing here runs where CUDA exists: there NCCL is the transport.
"""

import datetime
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


VLLM_FACTS = {
    "rendezvous": "vllm.distributed.weight_transfer.nccl_common: `trainer_init` (trainer, rank 0) and "
    "`worker_init_process_group` (server) get their communicator from the module's "
    "`stateless_init_process_group(master_address, master_port, rank, world_size, device)`, which "
    "rendezvous on a `StatelessProcessGroup` (a TCPStore).",
    "cuda_calls": "nccl_common and vllm.distributed.weight_transfer.packed_tensor reach CUDA only through "
    "`torch.accelerator.current_device_index()` and `torch.cuda.Stream` (packed_tensor._get_streams); "
    "`torch.cuda.stream(...)` is a no-op without CUDA.",
    "communicator": "the engine and the packed broadcast use the communicator only through "
    "`broadcast(tensor, src=..., stream=...)`; TRL's `VLLMClient.close_communicator` sets its "
    "`group.store` and `group.socket` to None.",
    "trl_client": "trl.generation.vllm_client (TRL 1.16, vLLM >= 0.28): `open_trainer_endpoint` is "
    "nccl_common's `trainer_init` and `packed_nccl_broadcast_producer` is packed_tensor's; "
    "`VLLMClient.init_communicator(device)` refuses a non-CUDA device, and with `torch.device('cuda')` "
    "(no index) sets no device.",
    "prepacking": "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm prepacks linear weights "
    "at load, which a weight update does not refresh (linear layers keep an empty weight: TRL's sync then "
    "fails), with zentorch on the ZenCPU platform, with sgl-kernel where `check_cpu_sgl_kernel` says so "
    "(AMX CPUs, bf16/fp16/int8 weights up to 1 MiB) and with oneDNN where "
    "`vllm._custom_ops._supports_onednn`; without them every layer computes torch.nn.functional.linear on "
    "its own weight.",
}
"""The private vLLM (0.30.0, scripts/vllm_cpu_env.sh) and TRL behaviour the stand-in rests on.

Where a change would make the stand-in a silent no-op, the fact is checked where it acts (`_check`); a change
of the rest fails loudly in the tests."""

WORKER_EXTENSION = "trl_lopti.cpu_backends.vllm_worker.WeightTransferOnCpu"
"""The `--worker-extension-cls` of a CPU server, which also reports the transfer over `/collective_rpc`."""


@dataclass
class GlooCommunicator:
    """
    What vLLM's weight transfer uses of its `PyNcclCommunicator` (`VLLM_FACTS["communicator"]`), over gloo.

    Args:
        group (`StatelessProcessGroup`):
            The rendezvous vLLM made: its TCPStore, rank and size.
        process_group (`torch.distributed.ProcessGroup`):
            The gloo group built on that store.
    """

    group: Any
    process_group: Any
    broadcasts: int = 0
    # By every communicator of this process, sent or received.
    broadcasts_in_process: ClassVar[int] = 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self.process_group.broadcast(tensor, src).wait()
        self.broadcasts += 1
        GlooCommunicator.broadcasts_in_process += 1


def gloo_init_process_group(
    master_address: str, master_port: int, rank: int, world_size: int, device: Any
) -> GlooCommunicator:
    """`nccl_common.stateless_init_process_group` with a gloo group in place of NCCL (same rendezvous)."""
    from vllm.distributed.utils import StatelessProcessGroup, init_gloo_process_group

    group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
    store = torch.distributed.PrefixStore("trl_lopti_weight_transfer", group.store)
    process_group = init_gloo_process_group(store, rank, world_size, timeout=datetime.timedelta(minutes=10))
    return GlooCommunicator(group, process_group)


class _Overlay:
    """A module as some code sees it: `overrides` first, the module's own attributes otherwise."""

    def __init__(self, module: Any, **overrides: Any):
        self._module = module
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides[name] if name in self._overrides else getattr(self._module, name)


class _CpuStream:
    """`torch.cuda.Stream` for the packed broadcast on a CPU, where gloo's broadcast returns when done."""

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
        raise RuntimeError(f"{__name__} is for machines without CUDA: with CUDA, NCCL is the transport")
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


def _disable_prepacking() -> None:
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    names = _names(utils.dispatch_cpu_unquantized_gemm)
    _check("prepacking", {"is_zen_cpu", "check_cpu_sgl_kernel", "_supports_onednn"} <= names)
    _check("prepacking", hasattr(_custom_ops, "_supports_onednn") and not current_platform.is_zen_cpu())
    utils.check_cpu_sgl_kernel = lambda n, k, dtype: False
    _custom_ops._supports_onednn = False


def install_server_side() -> None:
    """Makes this vLLM process send and receive weights over gloo, and compute with the updated weights."""
    _install_transport()
    _disable_prepacking()


def install_trainer_side() -> None:
    """
    Makes TRL's `VLLMClient` in this process join a CPU server's weight transfer, and a colocated vLLM follow
    the trainer's weights. Idempotent.
    """
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
