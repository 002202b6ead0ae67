"""Running work under a wall-clock limit, in this process or in a worker process.

In this process a `SIGALRM` timer or a helper thread enforces the limit. A [`WorkerProcess`] serves one
function of a `trl_lopti.tasks` module in its main thread, and is killed when it does not answer in time. The
worker imports the task module and what it needs; `import trl_lopti` imports no TRL."""

import atexit
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import DEVNULL, PIPE
from typing import Any, TypeVar


_T = TypeVar("_T")

# The timer repeats until disarmed, in case library code swallows the first interruption.
ALARM_REPEAT_SECONDS = 0.05
# How long a new worker may take to import its module and answer `ready`.
WORKER_STARTUP_SECONDS = 120.0
# How much longer than the work's own limit the parent waits for a worker's answer.
WORKER_GRACE_SECONDS = 1.0

# The worker imports the target's module from the folder holding `trl_lopti/` (`import trl_lopti` imports no
# TRL), then serves its calls.
_WORKER_SCRIPT = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
module_name, _, function_name = sys.argv[2].partition(":")
function = getattr(importlib.import_module(module_name), function_name)
function(*json.loads(sys.argv[3]))
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps(function(*json.loads(line))), flush=True)
"""


class DeadlineExceeded(BaseException):
    """Raised inside work that ran past its time limit (a `BaseException`, which libraries don't swallow)."""


def _run_with_alarm(func: Callable[[], _T], seconds: float) -> _T:
    """Runs `func` in the main thread, interrupted by `SIGALRM` after `seconds`; restores a prior timer."""

    def on_alarm(signum, frame):
        raise DeadlineExceeded()

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_SECONDS)
    started = time.monotonic()
    try:
        return func()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler if previous_handler is not None else signal.SIG_DFL)
        if previous_delay > 0:
            remaining = max(previous_delay - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, previous_interval)


def _run_in_thread(func: Callable[[], _T], seconds: float) -> _T:
    """Runs `func` in a helper thread and waits at most `seconds`.

    On timeout it stops the helper with an asynchronous `DeadlineExceeded` (raised at its next Python
    instruction, not inside C code) and raises it here."""
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = func()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error

    helper = threading.Thread(target=target, name="trl_lopti-time-limit", daemon=True)
    helper.start()
    helper.join(seconds)
    if helper.is_alive():
        thread_id = ctypes.c_ulong(helper.ident)
        if ctypes.pythonapi.PyThreadState_SetAsyncExc(thread_id, ctypes.py_object(DeadlineExceeded)) > 1:
            # Should not happen: don't disturb other threads.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(thread_id, None)
        raise DeadlineExceeded()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def in_main_thread() -> bool:
    """Whether this is the main thread of a platform with `SIGALRM` timers (where the alarm limit works)."""
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


def run_with_time_limit(func: Callable[[], _T], seconds: float | None) -> _T:
    """Runs `func()` in this process and raises [`DeadlineExceeded`] after `seconds` of wall-clock time.

    In the main thread a `SIGALRM` timer enforces the limit (any timer already set is restored afterwards);
    elsewhere a helper thread does, which cannot interrupt a long call into C code (a [`WorkerProcess`] can).
    `seconds` of `None` or `<= 0` sets no limit."""
    if seconds is None or seconds <= 0:
        return func()
    if in_main_thread():
        try:
            return _run_with_alarm(func, seconds)
        except ValueError as error:
            # Signals unavailable here (e.g. a sub-interpreter).
            if "signal" not in str(error):
                raise
    return _run_in_thread(func, seconds)


class WorkerProcess:
    """
    A child Python process that calls one function for the parent, one JSON-encoded call at a time.

    Calls from several threads wait their turn. A call that gets no answer in time kills the child (stuck,
    e.g. in C code) and returns `None`; the next call starts a new child.

    Args:
        target (`str`):
            The `"module:function"` of a module under `trl_lopti`, e.g.
            `"trl_lopti.tasks.math.grading:score_in_process"`, with JSON-serialisable arguments and result.
            It runs in the child's main thread, where [`run_with_time_limit`] can enforce its own limit.
        warmup_args (`tuple`, *optional*, defaults to `()`):
            The arguments of a first call made before the child reports ready (imports, caches).
    """

    def __init__(self, target: str, warmup_args: tuple = ()):
        self.target = target
        self.warmup_args = warmup_args
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def _wait_for_line(self, seconds: float | None) -> str | None:
        ready, _, _ = select.select([self._process.stdout], [], [], seconds)
        return self._process.stdout.readline() if ready else None

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        command = [sys.executable, "-c", _WORKER_SCRIPT, package_root, self.target, json.dumps(self.warmup_args)]
        self._process = subprocess.Popen(command, stdin=PIPE, stdout=PIPE, stderr=DEVNULL, text=True)
        if self._wait_for_line(WORKER_STARTUP_SECONDS) != "ready\n":
            self._stop()
            raise RuntimeError(f"The worker process for {self.target} did not start")

    def call(self, args: tuple, timeout_seconds: float | None) -> Any:
        """
        The target's result for `args`, or `None` when the child gave none in time and was killed.

        The child has `timeout_seconds` (the work's own limit; `None` or `<= 0`: none) plus
        [`WORKER_GRACE_SECONDS`] to answer.
        """
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            self._process.stdin.write(json.dumps(list(args)) + "\n")
            self._process.stdin.flush()
            wait = None
            if timeout_seconds is not None and timeout_seconds > 0:
                wait = timeout_seconds + WORKER_GRACE_SECONDS
            reply = self._wait_for_line(wait)
            # Too slow, or the child died.
            if not reply:
                self._stop()
                return None
            return json.loads(reply)

    def close(self) -> None:
        with self._lock:
            self._stop()


_workers: dict[str, WorkerProcess] = {}
_workers_lock = threading.Lock()


def shared_worker(target: str, warmup_args: tuple = ()) -> WorkerProcess | None:
    """The process-wide [`WorkerProcess`] of `target`, created on first use and closed at exit.

    `None` off POSIX, where `select` cannot wait on pipes."""
    if os.name != "posix":
        return None
    with _workers_lock:
        if target not in _workers:
            _workers[target] = WorkerProcess(target, warmup_args)
            atexit.register(_workers[target].close)
        return _workers[target]
