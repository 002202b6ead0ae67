"""How much of Lopti's second update pass an exact "LM head only where a pass needs it" scheme could save.

In a Lopti pass only the active tokens carry gradient: every inactive token has zero advantage, a neutralised KL term
and a stopped entropy gradient, so the gradient flowing into the LM head at an inactive position is exactly zero. Two
consequences, both exact for the gradient:

- low pass (first): `pi_old` of every completion token comes from this pass's own forward (on-policy), so the LM head
  must run forward at every completion position (without gradient), but its backward (the recomputed tile and two
  gradient GEMMs, about three forwards' worth) is needed only at the low positions: run the head a second time, with
  gradient, at the low positions only;
- high pass (second): `pi_old` is known, so the LM head runs, forward and backward, only at the high positions (the
  log-probabilities of the others can be read from `pi_old`: they only multiply zero advantages).

The backbone (all positions, as context) cannot be skipped in either pass. This script measures, on one micro-batch,
the process CPU time of forward+backward of:

- `trl`: TRL's own fused LM-head forward (`model(..., labels=..., fused_lm_head=True)`, as `GRPOTrainer` calls it;
  on CPU TRL scores every position, prompt included; on CUDA only the labelled ones);
- `full`: backbone + TRL's chunked log-prob kernel at every completion position, with gradient (one pass today, as
  TRL runs it on CUDA);
- `low`: backbone + the kernel without gradient at every completion position, then with gradient at a random
  `low_share` of them;
- `high`: backbone + the kernel only at the other positions;

and reports `(low + high) / full`, the loss+backward cost of a split Lopti relative to one GRPO pass (today: 2.0).

Usage:

    python benchmarks/lm_head_split.py --model smollm2 --low-share 0.2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402


def _load(model: str, tmp: str) -> tuple[Any, int]:
    from transformers import AutoModelForCausalLM

    if model == "smollm2":
        from trl_lopti.cli.demo_model import get_smollm2

        path = get_smollm2()
    else:
        from trl_lopti.models import build_tiny_model

        path = build_tiny_model(Path(tmp) / "tiny", hidden_size=64, num_hidden_layers=2)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy.train()
    return policy, policy.config.vocab_size


def measure(
    model: str = "smollm2",
    batch_size: int = 4,
    prompt_length: int = 47,
    completion_length: int = 48,
    low_share: float = 0.2,
    repeats: int = 3,
    threads: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """
    Times forward+backward of one micro-batch in the four ways described in the module docstring.

    Args:
        model (`str`, *optional*, defaults to `"smollm2"`):
            `"smollm2"` or `"tiny"`.
        batch_size (`int`, *optional*, defaults to `4`):
            Sequences in the micro-batch.
        prompt_length (`int`, *optional*, defaults to `47`):
            Prompt tokens per sequence.
        completion_length (`int`, *optional*, defaults to `48`):
            Completion tokens per sequence.
        low_share (`float`, *optional*, defaults to `0.2`):
            Share of completion tokens in the low group.
        repeats (`int`, *optional*, defaults to `3`):
            Timed repetitions of each way (the median is reported), after one untimed one.
        threads (`int`, *optional*, defaults to `1`):
            `torch.set_num_threads`.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the tokens and of the low/high split.

    Returns:
        `dict`: Median process CPU seconds per way, and the ratios.
    """
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import add_fused_lm_head

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        policy, vocab_size = _load(model, tmp)
    add_fused_lm_head(policy, temperature=1.0, outputs=("log_probs", "entropy"))
    length = prompt_length + completion_length
    input_ids = torch.randint(0, vocab_size, (batch_size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    advantages = torch.randn(batch_size, 1, generator=generator)
    # next-token positions that score completion tokens
    completion = torch.zeros(batch_size, length - 1, dtype=torch.bool)
    completion[:, prompt_length - 1 :] = True
    low = completion & (torch.rand(batch_size, length - 1, generator=generator) < low_share)
    high = completion & ~low
    weight = policy.get_output_embeddings().weight
    backbone = policy.base_model

    def kernel(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_probs, _entropy, *_ = ChunkedLogProbFunction.apply(
            hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("log_probs", "entropy")
        )
        return log_probs

    def step_trl() -> None:
        scored = torch.cat([torch.zeros(batch_size, 1, dtype=torch.bool), completion], 1)
        labels = input_ids.masked_fill(~scored, -100)
        outputs = policy(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        log_probs = outputs.log_probs
        (-(log_probs * advantages)[completion].sum()).backward()

    def hidden_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
        return hidden, input_ids[:, 1:]

    def step_full() -> None:
        hidden, targets = hidden_and_targets()
        log_probs = kernel(hidden[completion], targets[completion])
        (-(log_probs * advantages.expand_as(completion)[completion]).sum()).backward()

    def step_low() -> None:
        hidden, targets = hidden_and_targets()
        with torch.no_grad():  # pi_old of every completion token: it decides the split (on-policy first pass)
            kernel(hidden[completion].detach(), targets[completion])
        log_probs = kernel(hidden[low], targets[low])  # again with gradient, at the active (low) positions only
        (-(log_probs * advantages.expand_as(low)[low]).sum()).backward()

    def step_high() -> None:
        hidden, targets = hidden_and_targets()
        log_probs = kernel(hidden[high], targets[high])
        (-(log_probs * advantages.expand_as(high)[high]).sum()).backward()

    ways = {"trl": step_trl, "full": step_full, "low": step_low, "high": step_high}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(repeats + 1):
        for name, step in ways.items():
            policy.zero_grad(set_to_none=True)
            start = time.process_time()
            step()
            if repeat > 0:
                times[name].append(time.process_time() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "model": model,
        "batch_size": batch_size,
        "prompt_length": prompt_length,
        "completion_length": completion_length,
        "low_share_requested": low_share,
        "low_share": float(low.sum() / completion.sum()),
        "threads": threads,
        "repeats": repeats,
        "cpu_s": medians,
        "samples_cpu_s": times,
        "lopti_today_vs_one_pass": 2.0,
        "lopti_split_vs_one_pass_full": (medians["low"] + medians["high"]) / medians["full"],
        "one_pass_full_vs_trl_cpu_path": medians["full"] / medians["trl"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=47)
    parser.add_argument("--completion-length", type=int, default=48)
    parser.add_argument("--low-share", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None, help="JSON file to write")
    args = parser.parse_args()
    result = measure(
        args.model,
        args.batch_size,
        args.prompt_length,
        args.completion_length,
        args.low_share,
        args.repeats,
        args.threads,
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
