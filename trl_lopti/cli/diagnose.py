"""`trl-lopti diagnose`: the token diagnostics (`trl_lopti.diagnostics`) of a generation batch of the run that
`trl-lopti grpo` would train with the same options, plus [`DiagnoseArguments`]. With `num_iterations > 1`,
`num_iterations - 1` Adam steps (`learning_rate`) of TRL's loss on the batch come first. `--model_name_or_path smollm2`
is the demo's model. On a machine without an accelerator it runs on the CPU (`use_cpu`), and says so."""

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from trl import ModelConfig

from .. import LoptiGRPOConfig
from ..diagnostics import (
    DEFAULT_PROBE_METHODS,
    PROBE_METHODS,
    advance_policy_on_batch,
    check_probe_methods,
    format_tables,
    plot_report,
    run_token_diagnostics,
    sample_generation_batch,
)
from ..models import get_smollm2
from .parsing import CliError, LoptiParser, check_model_args, cpu_settings
from .train import LoptiScriptArguments, build_trainer


@dataclass
class DiagnoseArguments:
    """The diagnostics' own arguments (the run's are those of `trl-lopti grpo`)."""

    num_prompts: int | None = field(default=None, metadata={"help": "Prompts (default: a generation batch's)."})
    probe_methods: list[str] = field(
        default_factory=lambda: list(DEFAULT_PROBE_METHODS),
        metadata={
            "help": "Methods of the probability-shift probe ('none': no probe).",
            "choices": [*PROBE_METHODS, "none"],
        },
    )
    probe_lr: float = field(default=1e-3, metadata={"help": "Learning rate of the probe's SGD update."})
    summed_gradients: bool = field(default=True, metadata={"help": "Compute each quartile's summed gradient."})
    plots: bool = field(default=True, metadata={"help": "Write the bar charts (matplotlib) beside the report."})

    def __post_init__(self):
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts: must be a positive integer or None, got {self.num_prompts}")


def parse_args(argv: Sequence[str]) -> tuple:
    """[`DiagnoseArguments`] and `trl-lopti grpo`'s arguments `(LoptiScriptArguments, LoptiGRPOConfig, ModelConfig)`
    from the flags and `--config FILE|PRESET`; bad ones are refused before a model loads."""
    added = {} if torch.accelerator.is_available() else cpu_settings(argv, "trl-lopti diagnose")
    parser = LoptiParser((DiagnoseArguments, LoptiScriptArguments, LoptiGRPOConfig, ModelConfig), "diagnose")
    diagnose_args, script_args, training_args, model_args = parsed = parser.parse(argv, added)
    try:
        if script_args.trainer_class or script_args.config_class:
            raise CliError("trainer_class, config_class: options of trl-lopti grpo; diagnose probes LoptiGRPOTrainer")
        check_model_args(model_args)
        if script_args.dry_run or script_args.rehearse:
            raise CliError("dry_run, rehearse: options of trl-lopti grpo, not of diagnose")
        check_probe_methods([method for method in diagnose_args.probe_methods if method != "none"], training_args)
    except ValueError as error:
        raise CliError(parser.where(str(error))) from error
    return parsed


def main(argv: Sequence[str]) -> int:
    """`trl-lopti diagnose`: sample a generation batch of the run and write its token diagnostics."""
    # `smollm2`: the demo's model.
    if not argv:
        example = "diagnose --model_name_or_path smollm2 --kk_num_samples 8 --num_iterations 2 --output_dir diag"
        raise CliError(f"needs a model (--model_name_or_path: a folder or a hub id), e.g.\n  trl-lopti {example}")
    diagnose_args, script_args, training_args, model_args = parse_args(argv)
    if model_args.model_name_or_path.lower() == "smollm2" and not Path(model_args.model_name_or_path).exists():
        # The demo's model.
        model_args.model_name_or_path = get_smollm2()
    num_prompts = diagnose_args.num_prompts or training_args.generation_batch_size // training_args.num_generations
    trainer = build_trainer(script_args, training_args, model_args, num_prompts)
    inputs, summary = sample_generation_batch(trainer, list(trainer.train_dataset))
    print(f"generated {summary['num_completions']} completions (mean reward {summary['reward_mean']:.3f})", flush=True)
    micro_batch_size = training_args.per_device_train_batch_size
    steps = training_args.num_iterations - 1
    # TRL's last iteration on a batch sees the policy num_iterations - 1 steps on.
    inner = None
    if steps:
        inner = advance_policy_on_batch(trainer, inputs, steps, training_args.learning_rate, micro_batch_size)
    methods = [] if "none" in diagnose_args.probe_methods else diagnose_args.probe_methods
    options = dict(summed_gradients=diagnose_args.summed_gradients, probe_methods=methods, lr=diagnose_args.probe_lr)
    report = run_token_diagnostics(trainer, inputs, micro_batch_size=micro_batch_size, **options)
    command = "trl-lopti diagnose " + " ".join(argv)
    report.update(generation=summary, inner_steps=inner, command=command, args=asdict(diagnose_args))
    output_dir = Path(training_args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False))
    tables = format_tables(report)
    (output_dir / "report.md").write_text(f"`{report['command']}`\n\n{tables}\n")
    try:
        if diagnose_args.plots:
            plot_report(report, output_dir)
    except ImportError as error:
        # Matplotlib is an optional dependency (the `demo` extra).
        print(f"no plots ({error}); pip install matplotlib", file=sys.stderr)
    print(f"{tables}\n\nwrote the report to {output_dir}")
    return 0
