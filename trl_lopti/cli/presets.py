"""`trl-lopti presets [--dry_run | --path NAME]`: the presets installed with the package (the repository's `configs/`),
one line each: the name `--config` takes, the command that trains it, and what it reproduces (its header's first line
and script); then the folder of the `accelerate` launchers. `--dry_run`: each preset checked as `--dry_run` does on a
CPU, its line saying what was checked instead of what it reproduces. `--path NAME`: the installed file of a preset or
a launcher, for `accelerate launch --config_file "$(trl-lopti presets --path accelerate/fsdp2)" ...` from any
folder."""

import argparse
import re
from collections.abc import Sequence

from .base import CliError
from .preset_files import PRESETS, installed_file, preset_names


def main(argv: Sequence[str]) -> int:
    """`trl-lopti presets`: lists the presets, checks them (`--dry_run`) or prints one file's path (`--path NAME`).

    Args:
        argv (`Sequence[str]`): the arguments after `presets`.
    """
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="trl-lopti presets", description=__doc__, formatter_class=formatter)
    options = parser.add_mutually_exclusive_group()
    options.add_argument("--dry_run", action="store_true", help="check every preset (`make presets`)")
    options.add_argument("--path", metavar="NAME", help="print the installed file of a preset or a launcher, and exit")
    args = parser.parse_args(argv)
    if args.path:
        print(installed_file(args.path))
        return 0
    if not args.dry_run:
        print(f"presets in {PRESETS} (trl-lopti COMMAND --config NAME):")
    else:
        print(f"checking the presets in {PRESETS} as `trl-lopti COMMAND --config NAME --dry_run` does on a CPU:")
    names = preset_names(PRESETS)
    for name in names:
        path = PRESETS / f"{name}.yaml"
        text = path.read_text()
        command = (re.findall(r"^trainer: *(\w+)", text, re.MULTILINE) or ["grpo"])[0]
        # Checked on any machine, with the CPU settings: what was checked, else what it reproduces and the authors'
        # script, where one is named.
        if args.dry_run:
            what = check_preset(name, command)
        else:
            script = re.findall(r"\A.*\n# Reproduces scripts/(\S+)", text)
            what = text.splitlines()[0].lstrip("# ") + (f" (the authors' {script[0]})" if script else "")
        print(f"  {name:<{max(map(len, names))}}  {command}  {what}", flush=True)
    if not args.dry_run:
        print(f"launchers (accelerate launch --config_file FILE): {PRESETS / 'accelerate'}/*.yaml")
        return 0
    print(
        f"checked {len(names)} presets: the keys of each are fields of its command, its 3 dataclasses are built and "
        "valid (use_cpu=True), its reward functions import; no model or data loaded"
    )
    return 0


def check_preset(name: str, command: str) -> str:
    """What `trl-lopti COMMAND --config NAME --dry_run` checked of the preset `name`, on a CPU, in a few words; its
    error names the preset.

    Args:
        name (`str`): the preset's name.
        command (`str`): the command that trains it, `grpo` or `rloo`.
    """
    # Imported here: the list and --path load no TRL.
    from .train import checked_args

    try:
        script_args, training_args, _, resolved = checked_args(
            ["--config", str(PRESETS / f"{name}.yaml"), "--dry_run"], command, {"use_cpu": True}
        )
    except CliError as error:
        raise CliError(f"preset {name}: {error}") from error
    fields = len(resolved["config_file"])
    rewards = ", ".join(resolved["reward_funcs"])
    return f"ok: {fields} fields -> {type(training_args).__name__}; task {script_args.task}; rewards {rewards}"
