"""Run by tests/test_launchers.py, under `torchrun --nproc_per_node 2` or alone: a device mesh over a gloo group,
collectives on it, `destroy_process_group`, then `trl_lopti.__main__.exit_launched_process(code)`. Writes how many
gloo worker threads outlive `destroy_process_group` and, from an `atexit` handler, that the handlers ran."""

import atexit
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from trl_lopti.__main__ import exit_launched_process


def gloo_worker_threads() -> int:
    """This process's threads named as `ProcessGroupGloo`'s workers name theirs (Linux)."""
    tasks = Path("/proc/self/task").iterdir()
    return sum((task / "comm").read_text().startswith("pt_gloo_runloop") for task in tasks)


def main(output: str, code: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # FSDP2 keeps one like it past the trainer
    rank, values = dist.get_rank(), torch.ones(1 << 16)
    for _ in range(20):  # outputs dropped at once: the workers may release them after the main thread
        dist.all_gather(
            [torch.empty_like(values) for _ in range(dist.get_world_size())], values, group=mesh.get_group()
        )
    dist.destroy_process_group()
    Path(output, f"gloo_worker_threads_after_destroy_{rank}.txt").write_text(str(gloo_worker_threads()))
    atexit.register(Path(output, f"atexit_ran_{rank}.txt").write_text, os.environ["LOCAL_RANK"])
    exit_launched_process(int(code))


if __name__ == "__main__":
    main(*sys.argv[1:])
