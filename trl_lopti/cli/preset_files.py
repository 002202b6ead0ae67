"""The files installed with the package (the repository's `configs/`): the training presets, which `--config NAME`
takes, and the `accelerate` launchers, whose installed path `trl-lopti presets --path NAME` prints."""

from importlib.resources import files
from pathlib import Path

from .base import CliError, nearest


PRESETS = Path(str(files("trl_lopti"))) / "presets"
"""The presets installed with the package: the repository's `configs/` (`trl_lopti/presets` links to it)."""


def preset_names(folder: Path = PRESETS) -> list[str]:
    """The names of the training presets (`kk/qwen2.5-3b-instruct_ar_lopti`), the launchers left out.

    Args:
        folder (`Path`, *optional*): the folder that holds them; default the installed one.
    """
    paths = folder.glob("*/*.yaml")
    return sorted(f"{path.parent.name}/{path.stem}" for path in paths if path.parent.name != "accelerate")


def installed_file(name: str, option: str = "--path") -> Path:
    """The installed file of a preset or, for `--path`, a launcher, by its name (`accelerate/fsdp2`; `.yaml` optional).

    Args:
        name (`str`): the name, as `trl-lopti presets` lists it.
        option (`str`, *optional*): the option that takes it: `--path` (a preset or a launcher) or `--config`.
    """
    path = PRESETS / (name if name.endswith(".yaml") else f"{name}.yaml")
    if path.is_file():
        return path
    names = preset_names()
    kind = "a preset"
    if option == "--path":
        names += [f"accelerate/{launcher.stem}" for launcher in (PRESETS / "accelerate").glob("*.yaml")]
        kind = "a preset or a launcher"
    raise CliError(f"{option}: no file {name}, nor {kind} of that name{nearest(name, names)}")


def preset_path(name: str) -> Path:
    """`--config`'s file: a path, else a preset's name (`kk/qwen2.5-3b-instruct_ar_lopti`, `.yaml` optional).

    Args:
        name (`str`): the value of `--config`.
    """
    path = Path(name).expanduser()
    return path if path.is_file() else installed_file(name, "--config")
