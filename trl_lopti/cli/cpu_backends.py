"""FSDP2 and DeepSpeed on CPU processes (gloo), for `trl-lopti train --rehearse` and the launcher tests.

accelerate runs FSDP and DeepSpeed only on accelerators, although torch's `fully_shard` works on a CPU device mesh and
DeepSpeed has a CPU accelerator. Two wraps of accelerate's state code lift that, each resting on a fact written down
once (`PRIVATE_FACTS`) and checked where it acts; `check_backend` raises unless the trainer runs the launcher's backend.
"""

from __future__ import annotations

import functools
import os


PRIVATE_FACTS = {
    "fsdp": "accelerate 1.15: AcceleratorState.__init__(fsdp_plugin=...) sets DistributedType.FSDP and keeps the "
    "plugin only for accelerator devices; CPU processes (cpu=True) stay MULTI_CPU and drop it. Its __dict__ and "
    "PartialState's are the class attributes `_shared_state`.",
    "deepspeed": "accelerate 1.15: PartialState._prepare_backend(cpu, ...) picks gloo and MULTI_CPU only with "
    "cpu=True; PartialState starts DeepSpeed's process group, and AcceleratorState sets DistributedType.DEEPSPEED, "
    "only with cpu=False and ACCELERATE_USE_DEEPSPEED=true.",
    "shm_comm": "deepspeed 0.19: deepspeed.comm's TorchBackend JIT-builds the C++ op `deepspeed_shm_comm` (g++, "
    "minutes) unless `deepspeed.ops.__compatible_ops__['deepspeed_shm_comm']` is False; only DeepSpeed inference's "
    "`inference_all_reduce` uses it.",
}
"""The private accelerate and DeepSpeed behaviour the shims rely on."""

CPU_OVERRIDES = {"fsdp_or_ddp": {"use_cpu": True}, "deepspeed": {"use_cpu": False, "bf16": False}}
"""The training settings a CPU forces, per launcher kind, and nothing else. `use_cpu` gives gloo processes (MULTI_CPU,
which the FSDP shim turns into FSDP). DeepSpeed needs `use_cpu=False` (accelerate skips it otherwise), and transformers
then refuses `bf16` without a GPU: it is parsed False and set back to the launcher's `mixed_precision` afterwards (the
value DeepSpeed's config is checked against), so DeepSpeed runs the launcher's precision (shipped files: bf16)."""


def launcher_kind() -> str:
    """`"deepspeed"` or `"fsdp_or_ddp"`, from the environment `accelerate launch` sets for its config file."""
    return "deepspeed" if _flag("ACCELERATE_USE_DEEPSPEED") else "fsdp_or_ddp"


def install() -> dict:
    """
    Makes this process run the launcher's backend on CPU (idempotent); call it before any training arguments exist.

    Returns:
        `dict`: The training settings to override (this launcher kind's `CPU_OVERRIDES`).
    """
    from accelerate.state import AcceleratorState, PartialState

    if not getattr(AcceleratorState.__init__, "_trl_lopti_cpu", False):
        AcceleratorState.__init__ = _fsdp_on_cpu(AcceleratorState.__init__)
        PartialState._prepare_backend = _deepspeed_on_cpu(PartialState._prepare_backend)
    if launcher_kind() == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeed first picks its accelerator
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            raise RuntimeError(f"DeepSpeed picked the accelerator {get_accelerator().device_name()!r}, not 'cpu'")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # PRIVATE_FACTS["shm_comm"]: gloo does all
    return dict(CPU_OVERRIDES[launcher_kind()])


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true")


def _fsdp_on_cpu(init):
    @functools.wraps(init)
    def wrapped(self, *args, fsdp_plugin=None, **kwargs):
        from accelerate.state import DistributedType, PartialState

        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is None or self.distributed_type == DistributedType.FSDP:
            return
        if self.distributed_type != DistributedType.MULTI_CPU or "distributed_type" not in PartialState._shared_state:
            raise RuntimeError(f"FSDP on CPU rests on: {PRIVATE_FACTS['fsdp']} The state is {self.distributed_type}.")
        for state in (self.__dict__, PartialState._shared_state):
            state["distributed_type"] = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        if getattr(fsdp_plugin.cpu_offload, "pin_memory", False):  # torch pins memory only with an accelerator
            fsdp_plugin.cpu_offload = type(fsdp_plugin.cpu_offload)(pin_memory=False)
        self.fsdp_plugin = fsdp_plugin

    wrapped._trl_lopti_cpu = True
    return wrapped


def _deepspeed_on_cpu(prepare_backend):
    @functools.wraps(prepare_backend)
    def wrapped(self, cpu=False, *args, **kwargs):
        from accelerate.state import DistributedType

        if not _flag("ACCELERATE_USE_DEEPSPEED"):
            return prepare_backend(self, cpu, *args, **kwargs)
        backend, distributed_type = prepare_backend(self, True, *args, **kwargs)
        if distributed_type != DistributedType.MULTI_CPU:
            raise RuntimeError(f"DeepSpeed on CPU rests on: {PRIVATE_FACTS['deepspeed']} But got {distributed_type}.")
        return backend, distributed_type

    return wrapped


def check_backend(accelerator) -> str:
    """Raises unless `accelerator` runs the backend and process count the launcher asked for; returns them in words."""
    from accelerate.state import DistributedType

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    expected = {DistributedType.NO} if world_size == 1 else {DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
    if _flag("ACCELERATE_USE_FSDP"):
        expected = {DistributedType.FSDP}
    elif launcher_kind() == "deepspeed":
        expected = {DistributedType.DEEPSPEED}
    if accelerator.distributed_type not in expected or accelerator.num_processes != world_size:
        raise RuntimeError(
            f"the launcher asked for {sorted(map(str, expected))} on {world_size} processes, accelerate runs "
            f"{accelerator.distributed_type} on {accelerator.num_processes} (see trl_lopti.cli.cpu_backends)"
        )
    offload = getattr(getattr(accelerator.state, "fsdp_plugin", None), "cpu_offload", None)
    offload = f", {offload!r}" if hasattr(offload, "pin_memory") else ""
    processes = f"{accelerator.num_processes} process(es), {accelerator.device}"
    return f"{accelerator.distributed_type.value} on {processes}{offload}"
