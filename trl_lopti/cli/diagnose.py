"""`trl-lopti diagnose`: sample a GRPO batch with TRL's `GRPOTrainer` and write its token diagnostics.

```bash
trl-lopti diagnose --model_name_or_path smollm2 --task knights_knaves --num_prompts 8 --num_generations 8
trl-lopti diagnose --model_name_or_path ./my_model --task toy --inner_steps 2 --beta 0.04 --output_dir diag
```

The batch is TRL's own: `GRPOTrainer._generate_and_score_completions` generates the completions (sampling, EOS
masking), scores them with the task's reward and computes the group-normalised advantages, exactly as in training.
The measurements are those of [`trl_lopti.diagnostics.run_token_diagnostics`], on the trainer's model. Writes
`report.json` (everything, including the generation summary and the command), `report.md` (the tables) and
`gradients.png` / `probability_shift.png` to `--output_dir`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..diagnostics.measure import SUPPORTED_LOSS_TYPES
from ..diagnostics.probe import DEFAULT_PROBE_METHODS, PROBE_METHODS
from ..tasks._text import completion_to_text
from .errors import CliError


logger = logging.getLogger("trl_lopti.diagnostics")

SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct")
"""`--model_name_or_path` values that mean the offline SmolLM2-135M-Instruct of `trl_lopti.models.get_smollm2`."""

_TOY_PROMPTS = [
    "Write one short sentence about the sea.",
    "Name three colours.",
    "Count from one to five.",
    "Say hello in a friendly way.",
    "Describe a cat in a few words.",
    "What is two plus two?",
    "List some fruits.",
    "Give me a word that rhymes with cat.",
]


# ---------------------------------------------------------------------------------------------------------------------
# Rewards and tasks
# ---------------------------------------------------------------------------------------------------------------------
def toy_reward(completions: list[Any], **kwargs) -> list[float]:
    """Reward of `--task toy`: the share of letters among the completion's characters (varies on any model)."""
    texts = [completion_to_text(completion) for completion in completions]
    return [sum(char.isalpha() for char in text) / max(1, len(text)) for text in texts]


def constant_reward(completions: list[Any], **kwargs) -> list[float]:
    """Reward 1.0 for every completion: all advantages are zero."""
    return [1.0 for _ in completions]


def length_reward(completions: list[Any], **kwargs) -> list[float]:
    """Reward equal to the completion's length in characters."""
    return [float(len(completion_to_text(completion))) for completion in completions]


def kk_partial_reward(completions: list[Any], solution_text_format: list[str], **kwargs) -> list[float]:
    """Partial credit on Knights & Knaves for models too weak for the paper's all-or-nothing reward: the paper's reward
    plus, per person, +1/n when the response states "<name> is a <correct role>" (last statement) and -1/n when it
    states the wrong role. Only for diagnostics: it gives rewards that differ within a group of a small model."""
    from ..tasks.knights_knaves import knights_knaves_reward, parse_solution_text_format

    base = knights_knaves_reward(completions, solution_text_format, **kwargs)
    rewards = []
    for index, (completion, truth) in enumerate(zip(completions, solution_text_format)):
        text = completion_to_text(completion)
        roles = parse_solution_text_format(truth)
        bonus = 0.0
        for name, role in roles.items():
            said = re.findall(rf"\b{re.escape(name)}\b\s+is\s+a\s+(knight|knave)\b", text, re.IGNORECASE)
            if said:
                bonus += (1.0 if said[-1].lower() == role else -1.0) / len(roles)
        rewards.append(base[index] + bonus)
    return rewards


BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "constant": constant_reward,
    "kk_partial": kk_partial_reward,
    "length": length_reward,
    "toy": toy_reward,
}
"""Rewards that `--reward` can put in place of the task's."""


@dataclass
class DiagnoseArguments:
    """
    Arguments of `trl-lopti diagnose`. The loss settings (`temperature`, `beta`, `epsilon`, `epsilon_high`,
    `loss_type`, `no_bias_correction_kl`), the probe's `alpha` and `eta` and the batching (`micro_batch_size`,
    `no_share_prompts`) become one [`~trl_lopti.diagnostics.DiagnosticsSettings`]; see [`settings`].
    """

    model_name_or_path: str = field(
        metadata={"help": "Local model folder, or 'smollm2' for the offline SmolLM2-135M-Instruct of trl_lopti."}
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Reference model for the KL part of |w| (default: none, the policy is its reference)."},
    )
    task: str = field(
        default="knights_knaves", metadata={"help": "Prompts and reward.", "choices": ["knights_knaves", "toy"]}
    )
    reward: str | None = field(
        default=None,
        metadata={
            "help": "Replace the task's reward by a built-in one: constant, length, toy, or kk_partial (K&K: the "
            "paper's reward plus +-1/n per person whose role the response states; for small models).",
            "choices": sorted(BUILTIN_REWARDS),
        },
    )
    num_people: int = field(default=3, metadata={"help": "Knights & Knaves puzzle size."})
    num_prompts: int = field(default=4, metadata={"help": "Prompts of the batch."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (the GRPO group, at least 2)."})
    max_completion_length: int = field(default=128, metadata={"help": "Maximum tokens per completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature, also of the log-probabilities."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient of the measured loss."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping range (default: epsilon)."})
    loss_type: str = field(
        default="dapo", metadata={"help": "Loss normalisation.", "choices": list(SUPPORTED_LOSS_TYPES)}
    )
    no_bias_correction_kl: bool = field(
        default=False,
        metadata={"help": "Plain k3 KL term (TRL's use_bias_correction_kl=False); default: times the ratio."},
    )
    inner_steps: int = field(
        default=0,
        metadata={
            "help": "Adam steps of GRPO on the sampled batch before measuring (TRL's num_iterations - 1): ratios "
            "differ from one, clipping and (with --beta) the KL part become active; the reference is then the model "
            "that sampled the batch."
        },
    )
    inner_lr: float = field(default=1e-5, metadata={"help": "Learning rate of the --inner_steps."})
    alpha: float = field(default=0.3, metadata={"help": "Advantage Reweighting strength of the probe."})
    eta: float = field(default=0.5, metadata={"help": "Lopti threshold of the probe."})
    lr: float = field(default=1e-3, metadata={"help": "Learning rate of the probe's single step."})
    optimizer: str = field(default="sgd", metadata={"help": "Optimizer of the probe.", "choices": ["sgd", "adam"]})
    probe_methods: str = field(
        default=",".join(DEFAULT_PROBE_METHODS),
        metadata={"help": f"Comma-separated, from {','.join(PROBE_METHODS)}; 'none' to skip the probe."},
    )
    no_summed_gradients: bool = field(default=False, metadata={"help": "Skip the per-quartile parameter gradients."})
    micro_batch_size: int = field(
        default=4,
        metadata={"help": "Completions per forward/backward; a multiple of num_generations shares prompt forwards."},
    )
    no_share_prompts: bool = field(
        default=False,
        metadata={"help": "Run every full sequence instead of sharing a prompt's forward among its completions."},
    )
    torch_dtype: str = field(
        default="float32", metadata={"help": "Model dtype.", "choices": ["float32", "bfloat16", "float16"]}
    )
    output_dir: str = field(default="diagnostics", metadata={"help": "Folder of the report and plots."})
    no_plots: bool = field(default=False, metadata={"help": "Write report.json and report.md only."})
    seed: int = field(default=0, metadata={"help": "Seed of the prompts and of the sampling."})

    @property
    def methods(self) -> list[str]:
        """The probe methods, `[]` for `none`."""
        if self.probe_methods.strip().lower() == "none":
            return []
        return [method.strip() for method in self.probe_methods.split(",") if method.strip()]

    def settings(self):
        """The [`~trl_lopti.diagnostics.DiagnosticsSettings`] of these arguments."""
        from ..diagnostics import DiagnosticsSettings

        return DiagnosticsSettings(
            temperature=self.temperature, beta=self.beta, epsilon_low=self.epsilon, epsilon_high=self.epsilon_high,
            loss_type=self.loss_type, use_bias_correction_kl=not self.no_bias_correction_kl,
            max_completion_length=self.max_completion_length, alpha=self.alpha, eta=self.eta,
            micro_batch_size=self.micro_batch_size, share_prompt_forward=not self.no_share_prompts,
        )  # fmt: skip


def resolve_model_path(name_or_path: str) -> str:
    """A model folder: `name_or_path` itself, or the cached SmolLM2 folder for `smollm2` (see `SMOLLM2_NAMES`)."""
    if name_or_path.lower() in SMOLLM2_NAMES and not Path(name_or_path).exists():
        from ..models import get_smollm2

        return get_smollm2()
    return name_or_path


def task_rows(args: DiagnoseArguments) -> tuple[list[dict[str, Any]], Callable[..., list[float]]]:
    """
    The prompts of the batch, as dataset rows (a `prompt` and the columns the reward reads), and the reward.

    Args:
        args ([`DiagnoseArguments`]):
            `task`, `num_prompts`, `num_people`, `seed` and `reward`.

    Returns:
        `tuple[list[dict[str, Any]], Callable]`: The rows and the reward function.
    """
    if args.task == "knights_knaves":
        from ..tasks import knights_knaves

        dataset = knights_knaves.generate_dataset(num_people=args.num_people, num_samples=args.num_prompts,
                                                  seed=args.seed)  # fmt: skip
        rows = [dataset[index] for index in range(min(args.num_prompts, len(dataset)))]
        reward = knights_knaves.knights_knaves_reward
    else:
        prompts = [_TOY_PROMPTS[index % len(_TOY_PROMPTS)] for index in range(args.num_prompts)]
        rows, reward = [{"prompt": [{"role": "user", "content": prompt}]} for prompt in prompts], toy_reward
    return rows, BUILTIN_REWARDS[args.reward] if args.reward is not None else reward


# ---------------------------------------------------------------------------------------------------------------------
# The batch, from TRL
# ---------------------------------------------------------------------------------------------------------------------
def make_sampling_trainer(model_path: str, rows: list[dict[str, Any]], reward_func: Callable, args, output_dir: str):
    """
    A TRL `GRPOTrainer` that samples and scores the batch (generation batch: every prompt `num_generations` times).

    Its KL coefficient is 0 (TRL builds no reference model): the diagnostics' KL part comes from
    `--ref_model_name_or_path` or from `--inner_steps`, as the measured loss's `beta` says.

    Args:
        model_path (`str`):
            The policy's folder.
        rows (`list[dict[str, Any]]`):
            Dataset rows with a `prompt`.
        reward_func (`Callable`):
            TRL-style reward function.
        args ([`DiagnoseArguments`]):
            `num_generations`, `max_completion_length`, `temperature`, `torch_dtype`, `seed`.
        output_dir (`str`):
            The trainer's output folder (nothing is saved there).

    Returns:
        `trl.GRPOTrainer`: The trainer; its model is the policy the diagnostics measure.
    """
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=len(rows) * args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=args.temperature, top_p=1.0, top_k=0, beta=0.0, seed=args.seed, report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=False, save_strategy="no", gradient_checkpointing=False,
        model_init_kwargs={"dtype": args.torch_dtype},
    )  # fmt: skip
    return GRPOTrainer(model=model_path, reward_funcs=reward_func, args=config, train_dataset=Dataset.from_list(rows))


def sample_grpo_batch(trainer, rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """
    Generates, scores and computes the advantages of one GRPO batch with TRL's `_generate_and_score_completions`,
    as TRL does in training (every row repeated `num_generations` times, consecutively, as its `RepeatSampler` does).

    Args:
        trainer (`trl.GRPOTrainer`):
            The trainer (see [`make_sampling_trainer`]).
        rows (`Sequence[dict[str, Any]]`):
            The prompts, as dataset rows.

    Returns:
        `tuple[dict[str, Any], dict[str, Any]]`: TRL's `inputs` dict and a summary (rewards, lengths, texts).
    """
    import torch

    repeated = [dict(row) for row in rows for _ in range(trainer.num_generations)]
    model = trainer.model
    was_training = model.training
    model.train()  # TRL's training path: training group size and batch size
    try:
        inputs = trainer._generate_and_score_completions(repeated)
    finally:
        model.train(was_training)
    per_function = torch.tensor([list(values) for values in trainer._logs["rewards"].values()], dtype=torch.float32)
    rewards = torch.nan_to_num(per_function[:, -len(repeated) :], nan=0.0).sum(0)
    completion_mask, advantages = inputs["completion_mask"], inputs["advantages"]
    texts = [completion_to_text(completion) for completion in list(trainer._logs["completion"])[-len(repeated) :]]
    summary = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rewards": rewards.tolist(),
        "completion_length_mean": float(completion_mask.sum(1).float().mean()),
        "prompt_length_max": int(inputs["prompt_mask"].sum(1).max()),
        "num_completions": int(inputs["completion_ids"].size(0)),
        "num_zero_advantage_completions": int((advantages == 0).sum()),
        "sample_completions": texts[:3],
    }
    return inputs, summary


# ---------------------------------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> DiagnoseArguments:
    """Parses `trl-lopti diagnose` arguments (flags and/or `--config FILE.yaml`) with TRL's parser."""
    from .parsing import LoptiTrlParser, parse_with_config

    (args,) = parse_with_config(LoptiTrlParser(DiagnoseArguments, prog="trl-lopti diagnose"), argv)
    unknown = [method for method in args.methods if method not in PROBE_METHODS]
    if unknown:
        raise CliError(f"probe_methods: unknown method(s) {unknown}; choose from {list(PROBE_METHODS)} or 'none'")
    if args.num_generations < 2:
        raise CliError(
            f"num_generations: at least 2 (GRPO compares the completions of a prompt), got {args.num_generations}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """
    `trl-lopti diagnose`: sample a GRPO batch from a model on a task and write the token diagnostics.

    Args:
        argv (`Sequence[str]` or `None`, *optional*):
            Command-line arguments after `diagnose`; `None` reads `sys.argv`.

    Returns:
        `int`: Exit status, 0 on success.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from ..diagnostics import advance_policy_on_batch, format_tables, plot_report, run_token_diagnostics
    from ..diagnostics.measure import json_safe

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    settings = args.settings()
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    rows, reward_func = task_rows(args)
    with tempfile.TemporaryDirectory(prefix="trl-lopti-diagnose-") as trainer_dir:
        model_path = resolve_model_path(args.model_name_or_path)
        trainer = make_sampling_trainer(model_path, rows, reward_func, args, trainer_dir)
    model = trainer.model.eval()
    ref_model = None
    if args.ref_model_name_or_path:
        ref_path = resolve_model_path(args.ref_model_name_or_path)
        ref_model = AutoModelForCausalLM.from_pretrained(ref_path, dtype=getattr(torch, args.torch_dtype))
        ref_model.to(model.device)
        ref_model.eval()
    load_time = time.perf_counter() - started

    start = time.perf_counter()
    inputs, summary = sample_grpo_batch(trainer, rows)
    generation_time = time.perf_counter() - start
    logger.info("generated %d completions (mean reward %.3f) in %.1f s", summary["num_completions"],
                summary["reward_mean"], generation_time)  # fmt: skip

    inner = None
    if args.inner_steps > 0:
        start = time.perf_counter()
        inner = advance_policy_on_batch(model, inputs, args.inner_steps, args.inner_lr, settings)
        inner["time_s"] = time.perf_counter() - start

    report = run_token_diagnostics(model, inputs, ref_model, settings, summed_gradients=not args.no_summed_gradients,
                                   probe_methods=args.methods, lr=args.lr, optimizer=args.optimizer)  # fmt: skip
    total_time = time.perf_counter() - started
    report["timing_s"].update({"load": load_time, "generation": generation_time, "total": total_time})
    report.update(generation=summary, inner_steps=inner, command="trl-lopti diagnose " + " ".join(argv),
                  args=dataclasses.asdict(args))  # fmt: skip
    report = json_safe(report)

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False))
    tables = format_tables(report)
    (output_dir / "report.md").write_text(f"`{report['command']}`\n\n{tables}\n")
    plots = not args.no_plots
    if plots:
        try:
            plot_report(report, output_dir)
        except ImportError as error:  # matplotlib is an optional dependency (the `demo` extra)
            logger.warning("no plots (%s); pip install matplotlib", error)
            plots = False
    print(tables)
    print(f"\nwrote report.json, report.md{' and plots' if plots else ''} to {output_dir} in "
          f"{report['timing_s']['total']:.0f} s")  # fmt: skip
    return 0
