"""`trl-lopti presets [--dry_run]`: the presets installed with the package (the repository's `configs/`), one line each:
the name `--config` takes, the command that trains it, and what it reproduces (its header's first line and script);
then the folder of the `accelerate` launchers. `--dry_run`: each preset checked as `--dry_run` does on a CPU."""

import argparse
import re
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

from .main import CliError, nearest


PRESETS = Path(str(files("trl_lopti"))) / "presets"
"""The presets installed with the package: the repository's `configs/` (`trl_lopti/presets` links to it)."""


def preset_names() -> list[str]:
    """The names of the training presets (`kk/qwen2.5-3b-instruct_ar_lopti`), the launchers left out."""
    return sorted(
        f"{path.parent.name}/{path.stem}" for path in PRESETS.glob("*/*.yaml") if "accelerate" not in str(path)
    )


def preset_path(name: str) -> Path:
    """`--config`'s file: a path, else a preset's name (`kk/qwen2.5-3b-instruct_ar_lopti`, `.yaml` optional)."""
    path, preset = Path(name).expanduser(), PRESETS / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file() and not preset.is_file():
        raise CliError(f"--config: no file {name}, nor a preset of that name{nearest(name, preset_names())}")
    return path if path.is_file() else preset


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="trl-lopti presets", description=__doc__)
    parser.add_argument("--dry_run", action="store_true", help="check every preset (`make presets`)")
    if dry_run := parser.parse_args(argv).dry_run:  # (imported here: the list needs no TRL)
        from .train import checked_args
    print(f"presets in {PRESETS} (trl-lopti COMMAND --config NAME):")
    for name in (names := preset_names()):
        text = (PRESETS / f"{name}.yaml").read_text()
        command = (re.findall(r"^trainer: *(\w+)", text, re.MULTILINE) or ["grpo"])[0]
        if dry_run:
            checked_args(["--config", name, "--dry_run"], command, {"use_cpu": True})  # (on any machine)
        script = re.findall(r"\A.*\n# Reproduces scripts/(\S+)", text)  # the authors' script, where one is named
        what = text.splitlines()[0].lstrip("# ") + (f" (the authors' {script[0]})" if script else "")
        print(f"  {name:<{max(map(len, names))}}  {command}  {what}", flush=True)
    print(f"launchers (accelerate launch --config_file FILE): {PRESETS / 'accelerate'}/*.yaml")
    return 0
