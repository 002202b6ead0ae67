"""Run by tests/test_launchers.py, under `torchrun --nproc_per_node 2` or alone: a device mesh over a gloo group,
collectives on it, `destroy_process_group`, then `trl_lopti.__main__.exit_launched_process(code)`. Writes, into the
output folder, how many gloo worker threads outlive `destroy_process_group`, a file from a non-daemon thread that
finishes after the main thread, one from an `atexit` handler, and one from a global's `__del__` (interpreter teardown
would run it); prints `done` without a newline (an unflushed buffer)."""

import atexit
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from trl_lopti.__main__ import exit_launched_process


def gloo_worker_threads() -> int:
    """This process's threads named as torch's `ProcessGroupGloo` names its workers (Linux)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().startswith("pt_gloo_runloop")
        except OSError:  # a thread that ended meanwhile
            pass
    return count


class WritesAtTeardown:
    def __init__(self, path: Path):
        self.path = path

    def __del__(self):
        self.path.write_text("teardown ran")


def main(output: str, code: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # FSDP2 keeps one like it past the trainer
    values = torch.ones(1 << 16)
    for _ in range(20):  # outputs dropped at once: the workers may release them after the main thread
        dist.all_gather(
            [torch.empty_like(values) for _ in range(dist.get_world_size())], values, group=mesh.get_group()
        )
    dist.destroy_process_group()
    rank = int(os.environ["RANK"])
    folder = Path(output)
    (folder / f"gloo_worker_threads_after_destroy_{rank}.txt").write_text(str(gloo_worker_threads()))
    atexit.register((folder / f"atexit_ran_{rank}.txt").write_text, os.environ["LOCAL_RANK"])
    late = folder / f"thread_ran_{rank}.txt"
    threading.Thread(target=lambda: (time.sleep(0.5), late.write_text("ran")), daemon=False).start()
    globals()["writes_at_teardown"] = WritesAtTeardown(folder / f"teardown_ran_{rank}.txt")
    sys.stdout.write("done")  # no newline: left in the buffer
    exit_launched_process(int(code))


if __name__ == "__main__":
    main(*sys.argv[1:])
