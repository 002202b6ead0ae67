"""Single-digit arithmetic with the answer pre-filled: the task of `trl-lopti demo` and of the benchmarks.

A prompt is `"What is 7 - 3? The answer is"`, so that a completion is a few tokens, and the reward is 1 when
the first integer of the completion is the result, else 0. A small pretrained model (SmolLM2-135M-Instruct)
partly solves it, so the rewards of a GRPO group differ and training has a signal. Held-out problems come
from a fixed split per family ([`FAMILIES`], operands 0-9) and are never trained on.
"""

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from ._text import completion_to_text, token_parity_reward


ANSWER_PREFIX = "The answer is"
"""Pre-filled start of the answer: the completion's first integer is the model's answer."""

FAMILIES: dict[str, Callable[[range], list[tuple[str, int]]]] = {
    "add": lambda d: [(f"{a} + {b}", a + b) for a in d for b in d],
    "sub": lambda d: [(f"{a} - {b}", a - b) for a in d for b in d if a >= b],
    "mul": lambda d: [(f"{a} * {b}", a * b) for a in d for b in d],
    "add3": lambda d: [(f"{a} + {b} + {c}", a + b + c) for a in d for b in d for c in d],
}
"""Problem family -> its `(expression, result)` pairs for the operands `d` (0-9), in a fixed order."""

TASKS: dict[str, tuple[str, ...]] = {**{family: (family,) for family in FAMILIES}, "mixed": tuple(FAMILIES)}
"""Task name -> its problem families."""

_FIRST_INTEGER = re.compile(r"-?\d+")


def family_problems(family: str) -> list[tuple[str, int]]:
    """Every problem of a family of [`FAMILIES`], as `(prompt, answer)` in a fixed order."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    return [(f"What is {expression}? {ANSWER_PREFIX}", answer) for expression, answer in FAMILIES[family](range(10))]


def split_problems(
    task: str, num_eval_per_family: int, split_seed: int = 0
) -> tuple[dict[str, list[tuple[str, int]]], list[tuple[str, str, int]]]:
    """The problems of a task of [`TASKS`], split per family by `split_seed`.

    Returns `(train, held_out)`: the training problems per family, and `num_eval_per_family` held-out
    problems of each family (leaving at least one training problem) as `(family, prompt, answer)`."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    train = {}
    held_out = []
    for family in TASKS[task]:
        problems = family_problems(family)
        if not 1 <= num_eval_per_family < len(problems):
            raise ValueError(
                f"num_eval_per_family must leave training problems in family {family!r}: allowed range "
                f"[1, {len(problems) - 1}], got {num_eval_per_family}"
            )
        random.Random(f"{split_seed}-{family}").shuffle(problems)
        held_out += [(family, prompt, answer) for prompt, answer in problems[:num_eval_per_family]]
        train[family] = problems[num_eval_per_family:]
    return train, held_out


def build_train_dataset(train: dict[str, list[tuple[str, int]]], num_rows: int, seed: int):
    """A dataset (columns `prompt`, `answer`, `family`) of `num_rows` prompts from the training problems.

    The families of `train` come in turn (shuffled every round by `seed`), each with a random problem."""
    from datasets import Dataset

    rng = random.Random(seed)
    families = sorted(train)
    rows = []
    while len(rows) < num_rows:
        for family in rng.sample(families, len(families)):
            prompt, answer = rng.choice(train[family])
            rows.append({"prompt": prompt, "answer": answer, "family": family})
    return Dataset.from_list(rows[:num_rows])


def parse_answer(completion: Any) -> int | None:
    """The first integer of a completion (text or conversational), or `None`."""
    match = _FIRST_INTEGER.search(completion_to_text(completion))
    return int(match.group()) if match else None


def exact_answer_reward(completions: Sequence[Any], answer: Sequence[int], **kwargs: Any) -> list[float]:
    """TRL reward function: 1.0 when the first integer of the completion (a continuation of "The answer is")
    is the result in the dataset column `answer`, else 0.0."""
    return [1.0 if parse_answer(c) == int(y) else 0.0 for c, y in zip(completions, answer, strict=True)]


REWARDS: dict[str, Callable[..., list[float]]] = {"exact": exact_answer_reward, "token_parity": token_parity_reward}
"""Reward name -> TRL reward function (`token_parity` varies on random models, which never answer)."""


def evaluate_held_out(
    model,
    tokenizer,
    held_out: Sequence[tuple[str, str, int]],
    reward_func: Callable[..., list[float]],
    max_new_tokens: int,
    temperature: float,
    samples: int,
    seed: int,
) -> dict[str, Any]:
    """
    Greedy accuracy and mean reward of sampled answers on the held-out problems of [`split_problems`].

    `reward_func` is a reward of `REWARDS`, called as TRL calls it (completions, `answer`, `completion_ids`).
    Answers have at most `max_new_tokens` tokens; `samples` per problem are sampled at `temperature` in one
    batched `generate` call, seeded by `seed`. Meanwhile the model is in eval mode and the tokenizer pads on
    the left.

    Returns:
        `dict[str, Any]`:
            `accuracy` (greedy reward), `reward` (mean sampled reward), `per_family` (both per family),
            `num_prompts` and `num_samples`.
    """
    import torch

    families = [family for family, _, _ in held_out]
    prompts = [prompt for _, prompt, _ in held_out]
    answers = [answer for _, _, answer in held_out]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def rewards(generated: torch.Tensor, repeats: int) -> list[float]:
        completions = generated[:, encoded["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        ids = [row[row != pad_id].tolist() for row in completions]
        repeated_answers = [answer for answer in answers for _ in range(repeats)]
        return reward_func(completions=texts, answer=repeated_answers, completion_ids=ids)

    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    try:
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        common = dict(**encoded, max_new_tokens=max_new_tokens, pad_token_id=pad_id)
        with torch.no_grad():
            greedy = model.generate(**common, do_sample=False, temperature=None, top_p=None, top_k=None)
            greedy_rewards = rewards(greedy, 1)
            torch.manual_seed(seed)
            sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
            sampled = model.generate(**common, **sampling, num_return_sequences=samples)
            sampled_rewards = rewards(sampled, samples)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    per_family = {}
    for family in dict.fromkeys(families):
        rows = [i for i, f in enumerate(families) if f == family]
        sampled_rows = [sampled_rewards[i * samples + k] for i in rows for k in range(samples)]
        accuracy = sum(greedy_rewards[i] for i in rows) / len(rows)
        per_family[family] = {"accuracy": accuracy, "reward": sum(sampled_rows) / len(sampled_rows)}
    return {
        "accuracy": sum(greedy_rewards) / len(greedy_rewards),
        "reward": sum(sampled_rewards) / len(sampled_rewards),
        "per_family": per_family,
        "num_prompts": len(prompts),
        "num_samples": len(sampled_rewards),
    }
