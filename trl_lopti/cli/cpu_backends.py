"""FSDP2 and DeepSpeed on CPU processes (gloo), for `trl-lopti train --rehearse` and the launcher tests.

accelerate runs FSDP and DeepSpeed only on accelerator devices, although torch's `fully_shard` works on a CPU device
mesh and DeepSpeed has a CPU accelerator (`DS_ACCELERATOR=cpu`). Two wraps of accelerate's private state code lift
that, each resting on one fact of accelerate 1.15 (`ACCELERATE_FACTS`) and checked where it acts: a wrap that does
not take effect raises instead of silently running plain DDP or one process.
"""

from __future__ import annotations

import functools
import os


ACCELERATE_FACTS = {
    "fsdp": "AcceleratorState.__init__(fsdp_plugin=...) keeps the plugin and sets DistributedType.FSDP only for "
    "accelerator devices; CPU processes (cpu=True) stay MULTI_CPU and drop it. Its __dict__ and PartialState's are "
    "the class attributes `_shared_state`.",
    "deepspeed": "PartialState._prepare_backend(cpu, ...) picks gloo and MULTI_CPU only when cpu=True; PartialState "
    "starts DeepSpeed's process group (and AcceleratorState DistributedType.DEEPSPEED) only when cpu=False and "
    "ACCELERATE_USE_DEEPSPEED=true.",
}
"""The private accelerate behaviour each shim relies on (checked against accelerate 1.15)."""

SHM_COMM_OP = "deepspeed_shm_comm"
DEEPSPEED_FACT = (
    "deepspeed.comm's TorchBackend JIT-builds the C++ op `deepspeed_shm_comm` (g++, minutes) unless "
    "`deepspeed.ops.__compatible_ops__[name]` is False; only `inference_all_reduce` uses it, training runs on gloo."
)
"""The private DeepSpeed (0.19) behaviour the DeepSpeed shim relies on."""

CPU_OVERRIDES = {
    "fsdp_or_ddp": {"use_cpu": True},
    "deepspeed": {"use_cpu": False, "bf16": False},
}
"""The training settings a CPU forces, per launcher kind, and nothing else: `use_cpu` gives gloo processes (MULTI_CPU,
which the FSDP shim turns into FSDP); DeepSpeed needs `use_cpu=False` (accelerate skips it otherwise), and without
`use_cpu` transformers refuses `bf16` on a machine without a GPU, so DeepSpeed's precision comes from the launcher's
`mixed_precision` alone (the shipped zero2/zero3 files: bf16, as the presets)."""


def launcher_kind() -> str:
    """`"deepspeed"` or `"fsdp_or_ddp"`, from the environment `accelerate launch` sets for the config file."""
    return "deepspeed" if _flag("ACCELERATE_USE_DEEPSPEED") else "fsdp_or_ddp"


def install() -> dict:
    """
    Makes this process run the launcher's backend on CPU (idempotent); call it before the training arguments exist.

    Returns:
        `dict`: The training settings to override (`CPU_OVERRIDES` of this launcher kind).
    """
    from accelerate.state import AcceleratorState, PartialState

    if not getattr(AcceleratorState.__init__, "_trl_lopti_cpu", False):
        AcceleratorState.__init__ = _fsdp_on_cpu(AcceleratorState.__init__)
        PartialState._prepare_backend = _deepspeed_on_cpu(PartialState._prepare_backend)
    if launcher_kind() == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeed first picks its accelerator
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False  # DEEPSPEED_FACT: no C++ build, gloo serves training

        if get_accelerator().device_name() != "cpu":
            raise RuntimeError(f"DeepSpeed picked accelerator {get_accelerator().device_name()!r}, not 'cpu'")
    return dict(CPU_OVERRIDES[launcher_kind()])


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _fsdp_on_cpu(init):
    @functools.wraps(init)
    def wrapped(self, *args, fsdp_plugin=None, **kwargs):
        from accelerate.state import DistributedType, PartialState

        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is None or _world_size() < 2 or self.distributed_type == DistributedType.FSDP:
            return
        if self.distributed_type != DistributedType.MULTI_CPU:
            raise RuntimeError(f"FSDP on CPU: {ACCELERATE_FACTS['fsdp']} But the state is {self.distributed_type}.")
        for state in (self.__dict__, PartialState._shared_state):
            state["distributed_type"] = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin

    wrapped._trl_lopti_cpu = True
    return wrapped


def _deepspeed_on_cpu(prepare_backend):
    @functools.wraps(prepare_backend)
    def wrapped(self, cpu=False, *args, **kwargs):
        from accelerate.state import DistributedType

        if not _flag("ACCELERATE_USE_DEEPSPEED") or _world_size() < 2:
            return prepare_backend(self, cpu, *args, **kwargs)
        backend, distributed_type = prepare_backend(self, True, *args, **kwargs)
        if distributed_type != DistributedType.MULTI_CPU:
            raise RuntimeError(f"DeepSpeed on CPU: {ACCELERATE_FACTS['deepspeed']} But got {distributed_type}.")
        return backend, distributed_type

    return wrapped


def check_backend(accelerator) -> str:
    """
    Raises unless the accelerator runs the backend the launcher asked for; returns it in words.

    Args:
        accelerator (`accelerate.Accelerator`): The trainer's accelerator, after `install`.
    """
    from accelerate.state import DistributedType

    expected = DistributedType.NO if _world_size() < 2 else DistributedType.MULTI_CPU
    if _flag("ACCELERATE_USE_FSDP"):
        expected = DistributedType.FSDP
    elif launcher_kind() == "deepspeed":
        expected = DistributedType.DEEPSPEED
    if accelerator.distributed_type != expected or accelerator.num_processes != _world_size():
        raise RuntimeError(
            f"the launcher asked for {expected} on {_world_size()} processes, accelerate runs "
            f"{accelerator.distributed_type} on {accelerator.num_processes}: see trl_lopti.cli.cpu_backends"
        )
    return f"{accelerator.distributed_type.value} on {accelerator.num_processes} process(es), {accelerator.device}"
