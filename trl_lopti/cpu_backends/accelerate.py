"""FSDP2 and DeepSpeed on CPU processes (gloo), for `--rehearse` and the launcher tests.

Accelerate runs both only on accelerators: two wraps of its state code make them run on CPU, each resting on
a fact written down once (`PRIVATE_FACTS`) and checked where it acts. `check_backend` raises unless the
trainer runs the launcher's backend; `holdings` says what each process holds.
"""

import functools
import os

from accelerate.state import AcceleratorState, DistributedType, PartialState
from accelerate.utils import gather_object


PRIVATE_FACTS = {
    "fsdp": "accelerate 1.15: AcceleratorState.__init__(fsdp_plugin=...) sets DistributedType.FSDP and "
    "keeps the plugin only on accelerators (CPU processes stay MULTI_CPU); its state and PartialState's "
    "are `_shared_state`.",
    "deepspeed": "accelerate 1.15: PartialState._prepare_backend(cpu, ...) picks gloo and MULTI_CPU only "
    "with cpu=True; DeepSpeed's process group and DistributedType.DEEPSPEED need cpu=False, "
    "ACCELERATE_USE_DEEPSPEED=true.",
    "shm_comm": "deepspeed 0.19: deepspeed.comm JIT-builds the C++ op `deepspeed_shm_comm` (g++, minutes), "
    "used only by DeepSpeed inference, unless `deepspeed.ops.__compatible_ops__['deepspeed_shm_comm']` is "
    "False.",
}
"""The private accelerate and DeepSpeed behaviour the shims rely on."""

CPU_OVERRIDES = {"fsdp_or_ddp": {"use_cpu": True}, "deepspeed": {"use_cpu": False, "bf16": False}}
"""The training settings a CPU forces, and nothing else.

`use_cpu` gives gloo processes (MULTI_CPU, which the FSDP shim turns into FSDP). DeepSpeed needs
`use_cpu=False`, where transformers refuses `bf16` without a GPU: it is parsed False, then set back to the
launcher's `mixed_precision`, which DeepSpeed's config is checked against."""


def launcher_uses(backend: str) -> bool:
    """Whether the launcher runs `backend` (`"FSDP"`, `"DEEPSPEED"`), read from its `ACCELERATE_USE_*`."""
    return os.environ.get(f"ACCELERATE_USE_{backend}", "false").lower() in ("1", "true")


def install() -> dict:
    """Makes this process run the launcher's backend on CPU (idempotent), before training arguments exist.

    Returns:
        `dict`: The training settings to override (this launcher kind's `CPU_OVERRIDES`).
    """
    if not getattr(AcceleratorState.__init__, "_trl_lopti_cpu", False):
        AcceleratorState.__init__ = _fsdp_on_cpu(AcceleratorState.__init__)
        PartialState._prepare_backend = _deepspeed_on_cpu(PartialState._prepare_backend)
    if launcher_uses("DEEPSPEED"):
        # DeepSpeed reads it when it first picks its accelerator.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            raise RuntimeError(f"DeepSpeed picked the accelerator {get_accelerator().device_name()!r}, not 'cpu'")
        # Gloo does all the communication: don't build the shared-memory op (PRIVATE_FACTS["shm_comm"]).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return dict(CPU_OVERRIDES["deepspeed" if launcher_uses("DEEPSPEED") else "fsdp_or_ddp"])


def _fsdp_on_cpu(init):
    @functools.wraps(init)
    def wrapped(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is None or self.distributed_type == DistributedType.FSDP:
            return
        if self.distributed_type != DistributedType.MULTI_CPU or "distributed_type" not in PartialState._shared_state:
            raise RuntimeError(f"FSDP on CPU rests on: {PRIVATE_FACTS['fsdp']} The state is {self.distributed_type}.")
        for state in (self.__dict__, PartialState._shared_state):
            state["distributed_type"] = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        # Torch pins memory only with an accelerator.
        if getattr(fsdp_plugin.cpu_offload, "pin_memory", False):
            fsdp_plugin.cpu_offload = type(fsdp_plugin.cpu_offload)(pin_memory=False)
        self.fsdp_plugin = fsdp_plugin

    wrapped._trl_lopti_cpu = True
    return wrapped


def _deepspeed_on_cpu(prepare_backend):
    @functools.wraps(prepare_backend)
    def wrapped(self, cpu=False, *args, **kwargs):
        if not launcher_uses("DEEPSPEED"):
            return prepare_backend(self, cpu, *args, **kwargs)
        backend, distributed_type = prepare_backend(self, True, *args, **kwargs)
        if distributed_type != DistributedType.MULTI_CPU:
            raise RuntimeError(f"DeepSpeed on CPU rests on: {PRIVATE_FACTS['deepspeed']} But got {distributed_type}.")
        return backend, distributed_type

    return wrapped


def check_backend(accelerator) -> str:
    """The backend accelerate runs, in words; raises unless it is the launcher's, on as many processes."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    runs = accelerator.distributed_type.value
    asked = ["NO"] if world_size == 1 else ["MULTI_CPU", "MULTI_GPU"]
    asked = ["FSDP"] if launcher_uses("FSDP") else ["DEEPSPEED"] if launcher_uses("DEEPSPEED") else asked
    if runs not in asked or accelerator.num_processes != world_size:
        raise RuntimeError(
            f"the launcher asked for {asked} on {world_size} processes, accelerate runs {runs} on "
            f"{accelerator.num_processes} (see {__name__})"
        )
    offload = getattr(getattr(accelerator.state, "fsdp_plugin", None), "cpu_offload", None)
    offload = f", {offload!r}" if hasattr(offload, "pin_memory") else ""
    processes = f"{accelerator.num_processes} process(es), {accelerator.device}"
    return f"{runs} on {processes}, mixed precision {accelerator.mixed_precision}{offload}"


def holdings(trainer) -> dict[str, str]:
    """What each process holds of the parameters and of the optimizer's state, in words (gathered)."""

    def local(tensor) -> int:
        # ZeRO-3 holds its partition, or all of a "persistent" parameter; FSDP2 holds the DTensor's shard.
        if hasattr(tensor, "ds_tensor"):
            return tensor.ds_numel if getattr(tensor, "ds_persist", False) else tensor.ds_tensor.numel()
        return tensor.to_local().numel() if hasattr(tensor, "to_local") else tensor.numel()

    parameters = list(trainer.model.parameters())
    # The optimizer's state reads through its wrappers.
    state = [value for values in trainer.optimizer.state.values() for value in values.values() if value.dim()]
    kind = f"{type(parameters[0]).__name__} {getattr(parameters[0], 'ds_tensor', parameters[0]).dtype}"
    total = sum(getattr(p, "ds_numel", p.numel()) for p in parameters)
    state_dtype = state[0].dtype if state else "no"
    words = (
        f"parameters {kind}, {sum(map(local, parameters)):,} of {total:,} elements; "
        f"{trainer.args.optim.value} state {sum(map(local, state)):,} {state_dtype} elements"
    )
    return {f"process_{rank}": held for rank, held in enumerate(gather_object([words]))}
