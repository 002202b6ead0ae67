"""`trl-lopti diagnose`: sample a generation batch with a `LoptiGRPOTrainer` and write its token diagnostics.

```bash
trl-lopti diagnose --model_name_or_path smollm2 --task knights_knaves --per_device_train_batch_size 64
trl-lopti diagnose --model_name_or_path ./my_model --task toy --inner_steps 2 --beta 0.04 --output_dir diag
```

The command parses [`LoptiGRPOConfig`] and TRL's `ModelConfig` with the parser of `trl-lopti train` (the loss under
TRL's names; the probe's AR and Lopti settings are `advantage_reweighting_alpha` and `lopti_threshold` or
`lopti_quantile`), plus [`DiagnoseArguments`]. A [`LoptiGRPOTrainer`] built from them generates and scores one
generation batch (`per_device_train_batch_size` completions, `num_generations` per prompt) exactly as in training, and
[`trl_lopti.diagnostics.run_token_diagnostics`] measures it under the loss the configuration trains (any TRL loss).
Writes `report.json` (everything, with the generation summary and the command), `report.md` (the tables) and
`gradients.png` / `probability_shift.png` to `--output_dir`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..diagnostics.measure import DEFAULT_PROBE_METHODS, PROBE_METHODS
from ..tasks.knights_knaves.partial_credit import knights_knaves_partial_credit_reward
from ..tasks.toy import constant_reward, length_reward, letter_share_reward, toy_rows
from .errors import CliError


logger = logging.getLogger("trl_lopti.diagnostics")

BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "constant": constant_reward, "kk_partial": knights_knaves_partial_credit_reward, "length": length_reward,
    "toy": letter_share_reward,
}  # fmt: skip
"""Rewards that `--reward` can put in place of the task's (all in `trl_lopti.tasks`)."""

DIAGNOSE_TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "diagnostics", "per_device_train_batch_size": 32, "gradient_accumulation_steps": 1,
    "num_generations": 8, "max_completion_length": 128, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "beta": 0.0,
    "gradient_checkpointing": False, "bf16": False, "report_to": "none", "save_strategy": "no", "seed": 0,
}  # fmt: skip
"""Defaults of `trl-lopti diagnose` for fields of `LoptiGRPOConfig` (flags and `--config` override them)."""


@dataclass
class DiagnoseArguments:
    """The diagnostics' own arguments (the loss's are those of [`LoptiGRPOConfig`], the model's of `ModelConfig`)."""

    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Reference model of the KL term (default: the reference TRL builds when beta > 0)."},
    )
    task: str = field(
        default="knights_knaves", metadata={"help": "Prompts and reward.", "choices": ["knights_knaves", "toy"]}
    )
    reward: str | None = field(
        default=None,
        metadata={"help": "Replace the task's reward by a built-in one: constant, length, toy, or kk_partial (K&K: "
                  "the paper's reward plus +-1/n per person whose role the response states; for small models).",
                  "choices": sorted(BUILTIN_REWARDS)},  # fmt: skip
    )
    num_people: int = field(default=3, metadata={"help": "Knights & Knaves puzzle size."})
    inner_steps: int = field(
        default=0,
        metadata={"help": "Adam steps of TRL's loss on the sampled batch before measuring (TRL's num_iterations - 1): "
                  "ratios differ from one, clipping and (with --beta) the KL part become active."},  # fmt: skip
    )
    inner_lr: float = field(default=1e-5, metadata={"help": "Learning rate of the --inner_steps."})
    probe_lr: float = field(default=1e-3, metadata={"help": "Learning rate of the probe's update."})
    probe_optimizer: str = field(
        default="sgd", metadata={"help": "Optimizer of the probe.", "choices": ["sgd", "adam"]}
    )
    probe_methods: str = field(
        default=",".join(DEFAULT_PROBE_METHODS),
        metadata={"help": f"Comma-separated, from {','.join(PROBE_METHODS)}; 'none' to skip the probe."},
    )
    no_summed_gradients: bool = field(default=False, metadata={"help": "Skip the per-quartile parameter gradients."})
    micro_batch_size: int = field(default=4, metadata={"help": "Completions per forward/backward."})
    no_plots: bool = field(default=False, metadata={"help": "Write report.json and report.md only."})

    @property
    def methods(self) -> list[str]:
        """The probe methods, `[]` for `none`."""
        if self.probe_methods.strip().lower() == "none":
            return []
        return [method.strip() for method in self.probe_methods.split(",") if method.strip()]


def parse_args(argv: Sequence[str]) -> tuple:
    """
    Parses `trl-lopti diagnose` arguments (flags and/or `--config FILE.yaml`), refusing bad ones before a model loads.

    Args:
        argv (`Sequence[str]`):
            The arguments after `diagnose`.

    Returns:
        `tuple[DiagnoseArguments, LoptiGRPOConfig, trl.ModelConfig]`: The parsed arguments.
    """
    import torch
    from trl import ModelConfig, TrlParser

    from ..config import LoptiGRPOConfig
    from .parsing import parse_with_config

    parser = TrlParser((DiagnoseArguments, LoptiGRPOConfig, ModelConfig), prog="trl-lopti diagnose")
    parser.set_defaults(**DIAGNOSE_TRAINING_DEFAULTS, use_cpu=not torch.cuda.is_available())
    diagnose_args, training_args, model_args = parse_with_config(parser, argv)
    if not model_args.model_name_or_path:
        raise CliError("--model_name_or_path: required (a local model folder, a hub id, or 'smollm2')")
    unknown = [method for method in diagnose_args.methods if method not in PROBE_METHODS]
    if unknown:
        raise CliError(f"probe_methods: unknown method(s) {unknown}; choose from {list(PROBE_METHODS)} or 'none'")
    if not training_args.lopti_enabled and {"lopti", "lopti_ar"} & set(diagnose_args.methods):
        raise CliError("probe_methods: the Lopti probes need Lopti on (a lopti_threshold or a lopti_quantile)")
    return diagnose_args, training_args, model_args


def resolve_model_path(name_or_path: str) -> str:
    """A model to load: the cached SmolLM2 folder for `smollm2`, else a local folder or hub id."""
    if name_or_path.lower() in ("smollm2", "smollm2-135m-instruct") and not Path(name_or_path).exists():
        from .demo_model import get_smollm2

        return get_smollm2()
    from .parsing import check_model_name_or_path

    return check_model_name_or_path(name_or_path)


def task_rows(diagnose_args: DiagnoseArguments, num_prompts: int, seed: int) -> tuple[list[dict], Callable]:
    """The prompts of the batch as dataset rows (a `prompt` and the columns the reward reads), and the reward."""
    if diagnose_args.task == "knights_knaves":
        from ..tasks import knights_knaves

        dataset = knights_knaves.generate_dataset(
            num_people=diagnose_args.num_people, num_samples=num_prompts, seed=seed
        )
        rows = [dataset[index] for index in range(min(num_prompts, len(dataset)))]
        reward = knights_knaves.knights_knaves_reward
    else:
        rows, reward = toy_rows(num_prompts), letter_share_reward
    return rows, BUILTIN_REWARDS[diagnose_args.reward] if diagnose_args.reward is not None else reward


def main(argv: Sequence[str] | None = None) -> int:
    """
    `trl-lopti diagnose`: sample a generation batch from a model on a task and write the token diagnostics.

    Args:
        argv (`Sequence[str]` or `None`, *optional*):
            Command-line arguments after `diagnose`; `None` reads `sys.argv`.

    Returns:
        `int`: Exit status, 0 on success.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from .. import LoptiGRPOTrainer
    from ..diagnostics import (
        advance_policy_on_batch, format_tables, plot_report, run_token_diagnostics, sample_generation_batch,
    )  # fmt: skip

    argv = list(sys.argv[1:] if argv is None else argv)
    diagnose_args, training_args, model_args = parse_args(argv)
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    torch.manual_seed(training_args.seed)
    rows, reward_func = task_rows(diagnose_args, training_args.generation_batch_size // training_args.num_generations,
                                  training_args.seed)  # fmt: skip
    if model_args.dtype is not None:
        training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), "dtype": model_args.dtype}
    output_dir = Path(training_args.output_dir)
    with tempfile.TemporaryDirectory(prefix="trl-lopti-diagnose-") as trainer_dir:
        training_args.output_dir = trainer_dir  # the trainer saves nothing; the report goes to --output_dir
        trainer = LoptiGRPOTrainer(model=resolve_model_path(model_args.model_name_or_path), reward_funcs=reward_func,
                                   args=training_args, train_dataset=Dataset.from_list(rows))  # fmt: skip
    ref_model = None
    if diagnose_args.ref_model_name_or_path:
        ref_path = resolve_model_path(diagnose_args.ref_model_name_or_path)
        ref_model = AutoModelForCausalLM.from_pretrained(ref_path, dtype=trainer.model.dtype).to(trainer.model.device)
    inputs, summary = sample_generation_batch(trainer, rows)
    logger.info("generated %d completions (mean reward %.3f)", summary["num_completions"], summary["reward_mean"])
    inner = None
    if diagnose_args.inner_steps > 0:
        inner = advance_policy_on_batch(trainer, inputs, diagnose_args.inner_steps, diagnose_args.inner_lr,
                                        diagnose_args.micro_batch_size)  # fmt: skip
    report = run_token_diagnostics(trainer, inputs, summed_gradients=not diagnose_args.no_summed_gradients,
                                   probe_methods=diagnose_args.methods, lr=diagnose_args.probe_lr,
                                   optimizer=diagnose_args.probe_optimizer, ref_model=ref_model,
                                   micro_batch_size=diagnose_args.micro_batch_size)  # fmt: skip
    report.update(generation=summary, inner_steps=inner, command="trl-lopti diagnose " + " ".join(argv),
                  args=dataclasses.asdict(diagnose_args))  # fmt: skip
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False))
    tables = format_tables(report)
    (output_dir / "report.md").write_text(f"`{report['command']}`\n\n{tables}\n")
    plots = not diagnose_args.no_plots
    if plots:
        try:
            plot_report(report, output_dir)
        except ImportError as error:  # matplotlib is an optional dependency (the `demo` extra)
            logger.warning("no plots (%s); pip install matplotlib", error)
            plots = False
    print(tables)
    print(f"\nwrote report.json, report.md{' and plots' if plots else ''} to {output_dir}")
    return 0
