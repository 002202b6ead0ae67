"""A tiny random causal LM and tokenizer, built offline, for tests and benchmarks.

[`build_tiny_model`] writes a randomly initialised Qwen2 (or Llama) model and a byte-level BPE tokenizer with a chat
template to a local folder, so that every TRL code path that needs a model *path* (the reference model when
`beta > 0`, `vllm serve`, checkpoints) works without a hub. (The demo's pretrained model is
`trl_lopti.cli.demo_model.get_smollm2`.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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
"""`build_tiny_model` arguments of a model whose sampled tokens lie on both sides of eta = 0.5 (about 25% and 45% of
them above it at temperatures 1 and 0.7), whose float32 forward stays within ~5e-6 of float64 (small weights, large
logits only through the final norm), and whose attention heads (32 wide) vLLM's CPU attention takes."""


def build_tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer (`vocab_size`: the 256 byte symbols, merges and 3 special tokens), built offline,
    with Qwen-style special tokens (`eos_token="<|im_end|>"`, `pad_token="<|endoftext|>"`) and a chat template."""
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
    """
    Writes a tiny randomly initialised causal LM of a transformers model type (`architecture`: `"qwen2"`, `"llama"`,
    ...) and its tokenizer to `output_dir` (created if missing) and returns the folder, loadable with
    `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.

    The weights are initialised from `seed` on `device` (`"cuda"` initialises a large model in seconds). `logit_scale`
    multiplies the weight of the final norm, hence every logit: peaked next-token distributions while every weight
    stays small (see `PEAKED_TINY_MODEL`). `config_overrides` are other fields of the model config
    (`intermediate_size`, `num_attention_heads`, `vocab_size`, `tie_word_embeddings`, ...), e.g. to build a random
    model of a real model's shape; a `vocab_size` below the tokenizer's is raised to it (ids above the tokenizer's
    decode to nothing).
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
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return str(output_dir)
