"""`python -m trl_lopti ...` and the `trl-lopti` console script run the command line (also under `accelerate launch
-m trl_lopti ...`)."""

import atexit
import os
import sys
import threading
from typing import NoReturn

from .cli.main import main


def exit_launched_process(code: int) -> NoReturn:
    """Ends a process of `accelerate launch` or `torchrun` with exit code `code` once its exit handlers have run,
    without tearing the interpreter down.

    torch 2.13 keeps a process group alive after `destroy_process_group` while a device mesh holds it (FSDP2's does,
    past the trainer), so the group's gloo worker threads meet the interpreter's teardown, and one still releasing a
    collective's tensor then aborts a run that succeeded ("terminate called without an active exception", exit code
    -6; pytorch/pytorch#190489). What teardown would do first runs here, in `Py_Finalize`'s order: non-daemon threads
    are joined, then the `atexit` handlers run (TRL's vLLM client, trackers, logging), then the standard streams are
    flushed; the process then exits, so no `__del__` of a module global runs and a wrapper that acts after the module
    returns (`python -m cProfile -o ...`) does not. Call it from the main thread, as the last thing the process does.
    `tests/test_launchers.py` pins both the torch behaviour and this exit.

    Args:
        code (`int`): the exit code.
    """
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in {sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__}:
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            # None, closed or detached.
            pass
    os._exit(code)


def run() -> NoReturn:
    """The `trl-lopti` console script and `python -m trl_lopti`: exits with `trl_lopti.cli.main.main()`'s code, a
    launched process through `exit_launched_process`."""
    code = main()
    # accelerate launch and torchrun set LOCAL_RANK in each process they start.
    if "LOCAL_RANK" in os.environ:
        exit_launched_process(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
