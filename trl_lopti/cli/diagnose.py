"""`trl-lopti diagnose`: sample a generation batch with a `LoptiGRPOTrainer` and write its token diagnostics.

```bash
trl-lopti diagnose --model_name_or_path smollm2 --task knights_knaves --per_device_train_batch_size 64
trl-lopti diagnose --model_name_or_path ./my_model --task toy --inner_steps 2 --beta 0.04 --output_dir diag
```

The command parses [`LoptiGRPOConfig`] and TRL's `ModelConfig` with the same parser as `trl-lopti train` (the loss
settings under TRL's names: `temperature`, `beta`, `epsilon`, `epsilon_high`, `loss_type`, `use_bias_correction_kl`;
the probe's AR and Lopti settings are `advantage_reweighting_alpha` and `lopti_threshold` or `lopti_quantile`), plus
the fields of [`DiagnoseArguments`]. It builds a [`LoptiGRPOTrainer`] from them, which generates one generation batch
(`per_device_train_batch_size` completions, `num_generations` per prompt), scores it with the task's reward and
computes the advantages exactly as in training ([`trl_lopti.diagnostics.sample_generation_batch`]). The measurements
are those of [`trl_lopti.diagnostics.run_token_diagnostics`], on the trainer's model, for the loss its configuration
trains; a loss the diagnostics do not model is refused before any model is loaded. Writes `report.json` (everything,
including the generation summary and the command), `report.md` (the tables) and `gradients.png` /
`probability_shift.png` to `--output_dir`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..diagnostics.probe import DEFAULT_PROBE_METHODS, PROBE_METHODS
from ..tasks.knights_knaves.partial_credit import knights_knaves_partial_credit_reward
from ..tasks.toy import constant_reward, length_reward, letter_share_reward, toy_rows
from .errors import CliError


logger = logging.getLogger("trl_lopti.diagnostics")

SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct")
"""`--model_name_or_path` values that mean the offline SmolLM2-135M-Instruct (`trl_lopti.cli.demo_model`)."""

BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "constant": constant_reward,
    "kk_partial": knights_knaves_partial_credit_reward,
    "length": length_reward,
    "toy": letter_share_reward,
}
"""Rewards that `--reward` can put in place of the task's (all in `trl_lopti.tasks`)."""

DIAGNOSE_TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "diagnostics",
    "per_device_train_batch_size": 32,  # 4 prompts x 8 completions
    "gradient_accumulation_steps": 1,
    "num_generations": 8,
    "max_completion_length": 128,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "beta": 0.0,
    "gradient_checkpointing": False,
    "bf16": False,
    "report_to": "none",
    "save_strategy": "no",
    "seed": 0,
}
"""Defaults of `trl-lopti diagnose` for fields of `LoptiGRPOConfig` (flags and `--config` override them)."""


@dataclass
class DiagnoseArguments:
    """
    The diagnostics' own arguments (the loss's are those of [`LoptiGRPOConfig`], the model's those of `ModelConfig`).
    """

    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Reference model of the KL part of |w| (default: the reference TRL builds when beta > 0)."},
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
    inner_steps: int = field(
        default=0,
        metadata={
            "help": "Adam steps of GRPO on the sampled batch before measuring (TRL's num_iterations - 1): ratios "
            "differ from one, clipping and (with --beta) the KL part become active; the reference is then the model "
            "that sampled the batch."
        },
    )
    inner_lr: float = field(default=1e-5, metadata={"help": "Learning rate of the --inner_steps."})
    probe_lr: float = field(default=1e-3, metadata={"help": "Learning rate of the probe's single step."})
    probe_optimizer: str = field(
        default="sgd", metadata={"help": "Optimizer of the probe.", "choices": ["sgd", "adam"]}
    )
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
    no_plots: bool = field(default=False, metadata={"help": "Write report.json and report.md only."})

    @property
    def methods(self) -> list[str]:
        """The probe methods, `[]` for `none`."""
        if self.probe_methods.strip().lower() == "none":
            return []
        return [method.strip() for method in self.probe_methods.split(",") if method.strip()]


def make_parser():
    """
    The parser of `trl-lopti diagnose`: `(DiagnoseArguments, LoptiGRPOConfig, trl.ModelConfig)`, with its defaults.

    Returns:
        [`~trl.TrlParser`]: The parser.
    """
    import torch
    from trl import ModelConfig, TrlParser

    from ..config import LoptiGRPOConfig

    parser = TrlParser((DiagnoseArguments, LoptiGRPOConfig, ModelConfig), prog="trl-lopti diagnose")
    parser.set_defaults(**DIAGNOSE_TRAINING_DEFAULTS, use_cpu=not torch.cuda.is_available())
    return parser


def parse_args(argv: Sequence[str]) -> tuple:
    """
    Parses `trl-lopti diagnose` arguments (flags and/or `--config FILE.yaml`) and refuses, before any model is loaded,
    what the diagnostics cannot measure.

    Args:
        argv (`Sequence[str]`):
            The arguments after `diagnose`.

    Returns:
        `tuple[DiagnoseArguments, LoptiGRPOConfig, trl.ModelConfig]`: The parsed arguments.
    """
    from ..diagnostics.batch import check_loss_is_modelled
    from .parsing import parse_with_config

    diagnose_args, training_args, model_args = parse_with_config(make_parser(), argv)
    if not model_args.model_name_or_path:
        raise CliError("--model_name_or_path: required (a local model folder, a hub id, or 'smollm2')")
    unknown = [method for method in diagnose_args.methods if method not in PROBE_METHODS]
    if unknown:
        raise CliError(f"probe_methods: unknown method(s) {unknown}; choose from {list(PROBE_METHODS)} or 'none'")
    if not training_args.lopti_enabled and {"lopti", "lopti_ar"} & set(diagnose_args.methods):
        raise CliError("probe_methods: the Lopti probes need Lopti on (a lopti_threshold or a lopti_quantile)")
    try:
        check_loss_is_modelled(training_args)
    except ValueError as error:
        raise CliError(str(error)) from error
    return diagnose_args, training_args, model_args


def resolve_model_path(name_or_path: str) -> str:
    """A model to load: the cached SmolLM2 folder for `smollm2` (see `SMOLLM2_NAMES`), else a local folder or hub id."""
    if name_or_path.lower() in SMOLLM2_NAMES and not Path(name_or_path).exists():
        from .demo_model import get_smollm2

        return get_smollm2()
    from .parsing import check_model_name_or_path

    return check_model_name_or_path(name_or_path)


def task_rows(
    diagnose_args: DiagnoseArguments, num_prompts: int, seed: int
) -> tuple[list[dict[str, Any]], Callable[..., list[float]]]:
    """
    The prompts of the batch, as dataset rows (a `prompt` and the columns the reward reads), and the reward.

    Args:
        diagnose_args ([`DiagnoseArguments`]):
            `task`, `num_people` and `reward`.
        num_prompts (`int`):
            Prompts of the generation batch.
        seed (`int`):
            Seed of the puzzles.

    Returns:
        `tuple[list[dict[str, Any]], Callable]`: The rows and the reward function.
    """
    if diagnose_args.task == "knights_knaves":
        from ..tasks import knights_knaves

        dataset = knights_knaves.generate_dataset(num_people=diagnose_args.num_people, num_samples=num_prompts,
                                                  seed=seed)  # fmt: skip
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
        DiagnosticsSettings,
        advance_policy_on_batch,
        format_tables,
        plot_report,
        run_token_diagnostics,
        sample_generation_batch,
    )
    from ..diagnostics.measure import json_safe

    argv = list(sys.argv[1:] if argv is None else argv)
    diagnose_args, training_args, model_args = parse_args(argv)
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    torch.manual_seed(training_args.seed)
    started = time.perf_counter()
    num_prompts = training_args.generation_batch_size // training_args.num_generations
    rows, reward_func = task_rows(diagnose_args, num_prompts, training_args.seed)
    if model_args.dtype is not None:
        training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), "dtype": model_args.dtype}
    output_dir = Path(training_args.output_dir)
    with tempfile.TemporaryDirectory(prefix="trl-lopti-diagnose-") as trainer_dir:
        training_args.output_dir = trainer_dir  # the trainer saves nothing; the report goes to --output_dir
        trainer = LoptiGRPOTrainer(model=resolve_model_path(model_args.model_name_or_path), reward_funcs=reward_func,
                                   args=training_args, train_dataset=Dataset.from_list(rows))  # fmt: skip
    settings = DiagnosticsSettings.from_trainer(trainer, micro_batch_size=diagnose_args.micro_batch_size,
                                                share_prompt_forward=not diagnose_args.no_share_prompts)  # fmt: skip
    model = trainer.model
    ref_model = None
    if diagnose_args.ref_model_name_or_path:
        ref_model = AutoModelForCausalLM.from_pretrained(resolve_model_path(diagnose_args.ref_model_name_or_path),
                                                         dtype=model.dtype).to(model.device).eval()  # fmt: skip
    load_time = time.perf_counter() - started

    start = time.perf_counter()
    inputs, summary = sample_generation_batch(trainer, rows)
    generation_time = time.perf_counter() - start
    model.eval()
    if ref_model is not None:
        inputs.pop("ref_per_token_logps", None)  # measured against --ref_model_name_or_path instead
    logger.info("generated %d completions (mean reward %.3f) in %.1f s", summary["num_completions"],
                summary["reward_mean"], generation_time)  # fmt: skip

    inner = None
    if diagnose_args.inner_steps > 0:
        start = time.perf_counter()
        inner = advance_policy_on_batch(model, inputs, diagnose_args.inner_steps, diagnose_args.inner_lr, settings)
        inner["time_s"] = time.perf_counter() - start

    report = run_token_diagnostics(model, inputs, ref_model, settings,
                                   summed_gradients=not diagnose_args.no_summed_gradients,
                                   probe_methods=diagnose_args.methods, lr=diagnose_args.probe_lr,
                                   optimizer=diagnose_args.probe_optimizer)  # fmt: skip
    total_time = time.perf_counter() - started
    report["timing_s"].update({"load": load_time, "generation": generation_time, "total": total_time})
    report.update(generation=summary, inner_steps=inner, command="trl-lopti diagnose " + " ".join(argv),
                  args=dataclasses.asdict(diagnose_args))  # fmt: skip
    report = json_safe(report)

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
    print(f"\nwrote report.json, report.md{' and plots' if plots else ''} to {output_dir} in "
          f"{report['timing_s']['total']:.0f} s")  # fmt: skip
    return 0
