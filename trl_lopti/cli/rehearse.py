"""`trl-lopti grpo --rehearse` (and `rloo`): a preset's launch (launcher, parser, task, reward, trainer) rehearsed offline
with a tiny random model of its family and a few prompts of its task: one Lopti cycle, a checkpoint after the first
pass and a resume from it. It fails (exit 1) unless every pass trained tokens with a gradient; it measures no GPU memory
or speed. Without a GPU the launcher's backend runs on CPU processes (`cpu_backends`), and a vLLM server-mode preset
trains against a CPU `vllm serve` where vLLM is installed (`cpu_backends.vllm_server.ServerRuns`)."""

import json
import os
import shutil
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from ..cpu_backends import accelerate as cpu_backends
from ..cpu_backends import vllm_server
from ..models import PEAKED_TINY_MODEL, build_tiny_model
from ..tasks.math import make_math_prompt
from .base import CliError
from .parsing import LoptiParser, cpu_settings
from .train import DEFAULT_REWARD_FUNCS, config_file_over_defaults, parse_train_args, run_training, train_parser


REHEARSAL_SCALE = dict(rows_per_optimizer_step=8, per_device_train_batch_size=2, max_completion_length=16, prompts=32)
"""What a rehearsal shrinks (completions per optimizer step: on all processes). The optimizer steps per generation
batch and every method, loss, optimizer and precision setting stay the preset's."""

REHEARSAL_REWARD = "token_parity_reward"
"""Added to the preset's rewards (`trl_lopti.tasks.token_parity_reward`): a random model never earns a task's reward
(equal scores: zero advantages), and this one varies on any model."""

RESUME_TOLERANCE = 1e-6
"""The largest parameter difference between the resumed and the uninterrupted run (measured: 0 on every launcher)."""

FAMILIES = {"qwen": "qwen2", "llama": "llama", "smollm": "llama"}
"""Tiny model architecture (`trl_lopti.models.build_tiny_model`) by a part of the model's name or `model_type`."""

WRITTEN = ("run", "resumed", "tiny-*", "math.parquet", "vllm_server.log", "rehearsal.json")
"""What a rehearsal writes in its folder (`OUTPUT_DIR-rehearsal`), which the next one clears first."""


def main(argv: list[str], command: str) -> int:
    """Rehearses `trl-lopti COMMAND ARGV` (`grpo` or `rloo`, with `--rehearse`); returns the exit code.

    Args:
        argv (`list[str]`): the arguments after the command.
        command (`str`): `grpo` or `rloo`.
    """
    start = time.perf_counter()
    say = print if os.environ.get("RANK", "0") == "0" else (lambda *_: None)
    overrides = {} if torch.cuda.is_available() else cpu_backends.install()
    # the settings transformers, accelerate and DeepSpeed need to run the launcher on CPU processes
    added = cpu_settings(argv, f"trl-lopti {command} --rehearse", overrides) if overrides else {}

    def parse(*flags: dict[str, Any], parser: LoptiParser | None = None):
        args = list(argv)
        for name, value in (item for values in flags for item in values.items()):
            args += [f"--{name}", *map(str, value)] if isinstance(value, list) else [f"--{name}={value}"]
        script_args, training_args, model_args = parse_train_args(args, command, added, parser)
        # DeepSpeed's config checks bf16 against the launcher's mixed precision.
        if overrides and cpu_backends.launcher_uses("DEEPSPEED"):
            training_args.bf16 = training_args.mixed_precision == "bf16"
        return script_args, training_args, model_args

    parser = train_parser(command, argv)
    script_args, training_args, model_args = parse(parser=parser)
    # The tiny model is built whole on the main process, not under ZeRO-3's zero.Init.
    unset_hf_deepspeed_config()
    folder = Path(f"{training_args.output_dir}-rehearsal")
    # Said after the run's first line (where it trains).
    said = []
    over_defaults = config_file_over_defaults(parser, training_args)
    if over_defaults:
        said.append(over_defaults)
    # The main process clears an earlier rehearsal's folder, then writes the model and data.
    with training_args.main_process_first(desc="rehearsal inputs"):
        if training_args.local_process_index == 0:
            clear(folder)
        scale = _scaled_flags(script_args, training_args, model_args, folder, said.append)
    checkpoint = folder / "run" / f"checkpoint-{scale['save_steps']}"
    served = scale["model_name_or_path"] if training_args.use_vllm and scale.get("use_vllm", True) else None
    with vllm_server.ServerRuns.start(served and str(served), folder / "vllm_server.log") as vllm:

        def prepare(trainer) -> None:
            for line in said:
                say(line)
            vllm.attach(trainer)

        trainer = run_training(*parse(scale, vllm.flags()), end=False, prepare=prepare)
        # The generation batch a checkpoint between the passes keeps.
        batches = ", ".join(sorted(path.name for path in checkpoint.glob("lopti_generation_batch*")))
        report = {
            "trainer": type(trainer).__name__,
            "backend": cpu_backends.check_backend(trainer.accelerator),
            "cpu_overrides": overrides,
            **cpu_backends.holdings(trainer),
            **_passes(trainer),
            "checkpoint": f"{checkpoint} (with {batches or 'no batch'})",
        }
        # vLLM: sent before each generation batch, never between its passes.
        cycle = scale["max_steps"] // 2
        vllm.check(report, "run", expected_sync_steps=[0, cycle])
        del trainer
        resumed_flags = {"resume_from_checkpoint": checkpoint, "output_dir": folder / "resumed"}
        resumed = run_training(*parse(scale, vllm.flags(), resumed_flags), prepare=vllm.attach, say_where=False)
        # The stored batch's high pass first: no sync.
        vllm.check(report, "resumed", expected_sync_steps=[cycle])
    # The resumed run's final model, against the uninterrupted run's.
    if resumed.accelerator.is_main_process:
        run, rerun = (load_file(folder / name / "model.safetensors") for name in ("run", "resumed"))
        difference = report["resume_max_abs_difference"] = max(
            float((run[k].double() - rerun[k].double()).abs().max()) for k in run
        )
        if difference > RESUME_TOLERANCE:
            report["failures"].append(f"the resumed run ended {difference:.3g} from the uninterrupted run's")
        report["seconds"] = round(time.perf_counter() - start, 1)
        (folder / "rehearsal.json").write_text(json.dumps(report, indent=2, default=str))
        for key, value in report.items():
            say(f"rehearse: {key}: {value}")
        say(
            f"rehearse: {'FAILED' if report['failures'] else 'passed'} (report {folder / 'rehearsal.json'}); nothing "
            "here measures GPU memory or speed"
        )
    return 1 if report["failures"] else 0


def clear(folder: Path) -> None:
    """Removes an earlier rehearsal's `folder`, so that this one reads none of its files (a checkpoint of another
    launcher would not resume); refuses a folder that holds anything a rehearsal does not write.

    Args:
        folder (`Path`): the rehearsal's folder.
    """
    others = [path.name for path in folder.glob("*") if not any(fnmatch(path.name, name) for name in WRITTEN)]
    if others:
        raise CliError(f"rehearse: {folder} holds files a rehearsal does not write ({', '.join(sorted(others))})")
    shutil.rmtree(folder, ignore_errors=True)


def _scaled_flags(script_args, training_args, model_args, folder: Path, say) -> dict[str, Any]:
    """The flags that scale a parsed preset down to a rehearsal, with the inputs they name; says what they change."""
    folder.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = REHEARSAL_SCALE["rows_per_optimizer_step"]
    per_device = min(REHEARSAL_SCALE["per_device_train_batch_size"], rows // world)
    steps_per_pass, rest = divmod(training_args.lopti_pass_micro_steps, training_args.gradient_accumulation_steps)
    if world not in (1, 2, 4, 8) or rest:
        raise CliError(
            f"rehearse: needs 1, 2, 4 or 8 processes (got {world}) and steps_per_generation * "
            "num_iterations a multiple of gradient_accumulation_steps"
        )
    accumulation = rows // (per_device * world)
    cycle_steps = training_args.lopti_num_passes * steps_per_pass
    vllm_reason = vllm_server.unavailable(training_args) if training_args.use_vllm else None
    # vLLM: two generation batches.
    max_steps = (2 if training_args.use_vllm and not vllm_reason else 1) * cycle_steps
    # A local model under 100 MB as it is, else a tiny one.
    model = Path(model_args.model_name_or_path).expanduser()
    if not (model.is_dir() and sum(file.stat().st_size for file in model.glob("*.safetensors")) < 100e6):
        model_type = json.loads((model / "config.json").read_text())["model_type"] if model.is_dir() else str(model)
        family = next((arch for key, arch in FAMILIES.items() if key in model_type.lower()), None)
        if family is None:
            raise CliError(f"rehearse: no tiny model of the family of {str(model)!r}; known: {sorted(FAMILIES)}")
        model = folder / f"tiny-{family}"
        if not (model / "config.json").is_file():
            build_tiny_model(model, architecture=family, **PEAKED_TINY_MODEL)
    flags = {
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "steps_per_generation": steps_per_pass * accumulation // training_args.num_iterations,
        "max_steps": max_steps,
        "max_completion_length": REHEARSAL_SCALE["max_completion_length"],
        "save_strategy": "steps",
        "save_steps": max(1, cycle_steps // 2),
        "eval_strategy": "no",
        "report_to": "none",
        "push_to_hub": False,
        "logging_steps": 1,  # one log per optimizer step: the passes are read from the logs
        "output_dir": folder / "run",
        "model_name_or_path": model,
        "reward_funcs": [*(script_args.reward_funcs or DEFAULT_REWARD_FUNCS[script_args.task]), REHEARSAL_REWARD],
    }
    if training_args.reward_weights is not None:
        flags["reward_weights"] = [*training_args.reward_weights, 1.0]
    if vllm_reason:
        flags["use_vllm"] = False
        say(
            f"rehearse: vLLM ({training_args.vllm_mode} mode) NOT rehearsed: {vllm_reason}; completions come from "
            "transformers' generate"
        )
    elif training_args.use_vllm:
        # Seeded sampling: the resumed run samples the second batch as the uninterrupted one.
        seeded = {**(training_args.generation_kwargs or {}), "seed": training_args.seed}
        flags["generation_kwargs"] = json.dumps(seeded)
        say(
            f"rehearse: vLLM server mode: a CPU `vllm serve` of {model} (log {folder / 'vllm_server.log'}), two "
            "generation batches, seeded sampling"
        )
    data = script_args.dataset_name
    if script_args.task == "knights_knaves":
        flags.update(kk_source="generated", kk_num_samples=REHEARSAL_SCALE["prompts"])
        data = f"{REHEARSAL_SCALE['prompts']} K&K puzzles generated offline ({script_args.kk_num_people} people)"
    elif script_args.task == "math":
        # In the authors' parquet layout.
        flags.update(dataset_name="dsr_uniform", math_data_file=folder / "math.parquet")
        data = "8 local addition problems in the authors' format"
        problems = [
            {"prompt": make_math_prompt(f"What is {a} + {b}?"), "reward_model": {"ground_truth": str(a + b)}}
            for a in range(3, 7)
            for b in range(11, 13)
        ]
        # Written once, by the main process.
        if not flags["math_data_file"].is_file():
            Dataset.from_list(problems).to_parquet(flags["math_data_file"])
    say(
        f"rehearse: model {model_args.model_name_or_path} -> {model}; data: {data}; rewards: "
        f"{', '.join(flags['reward_funcs'])} (the last added: it varies on any model); schedule: {max_steps} optimizer "
        f"steps of {rows} completions on {world} process(es) ({per_device} x {accumulation} micro-steps), checkpoint "
        f"after step {flags['save_steps']}, then a resume"
    )
    return flags


def _passes(trainer) -> dict[str, Any]:
    """From the logs: each pass's optimizer steps and gradient norms, eta, the low-token share, and what failed."""
    logs = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    lopti = trainer.args.lopti_enabled
    eta = [entry["lopti/threshold"] for entry in logs if "lopti/threshold" in entry]
    shares = [entry["lopti/low_token_share"] for entry in logs if "lopti/low_token_share" in entry]
    report = {"eta": eta, "low_token_share": shares}
    failures = [
        f"the {'low' if share == 0 else 'high'} pass trained no token (low-token share {share})"
        for share in shares
        if lopti and not 0 < share < 1
    ]
    for group in ("low", "high") if lopti else ("single",):
        entries = [entry for entry in logs if not lopti or f"lopti/loss_{group}_pass" in entry]
        report[f"{group}_pass_steps"] = [entry["step"] for entry in entries]
        report[f"{group}_pass_grad_norms"] = [float(f"{entry['grad_norm']:.4g}") for entry in entries]
        if not entries or min(entry["grad_norm"] for entry in entries) <= 0:
            failures.append(f"the {group} pass carried no gradient")
    return {**report, "failures": failures}
