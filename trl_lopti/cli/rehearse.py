"""`trl-lopti train --rehearse`: a preset's launch, rehearsed on CPU processes before paying for GPUs.

```bash
accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 -m trl_lopti train \
    --config configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml --rehearse
```

It runs the preset's launcher (backend, processes, mixed precision), parser, task, reward and trainer settings with a
tiny random model of the preset's family (or a local model under 100 MB as it is) and a few prompts of its task,
offline (`REHEARSAL_SCALE`): one Lopti cycle with a checkpoint after the first pass and the final save, then a resume
from that checkpoint, as `--resume_from_checkpoint` runs it. It prints what it verified. It measures neither GPU
memory nor speed. Without a GPU the launcher's backend runs on gloo (`trl_lopti.cli.cpu_backends`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .errors import CliError


REHEARSAL_SCALE = {
    "rows_per_optimizer_step": 8,  # completions per optimizer step, all processes together
    "per_device_train_batch_size": 2,
    "max_completion_length": 16,
    "prompts": 32,
    "max_local_model_bytes": 100e6,
}
"""What a rehearsal shrinks. The optimizer steps per generation batch, the group size and every method, loss,
optimizer and precision setting stay the preset's; evaluation, logging services and hub uploads are off."""

FAMILIES = {"qwen": "qwen2", "llama": "llama", "smollm": "llama"}
"""Tiny model architecture (`trl_lopti.models.build_tiny_model`) by the model's name or `model_type`."""


def main(argv: list[str]) -> int:
    """
    Rehearses `trl-lopti train ARGV` (with `--rehearse` among ARGV) and prints what it verified.

    Returns:
        `int`: The exit code.
    """
    import torch
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from . import cpu_backends
    from .train import parse_train_args, run_training

    start, say = time.perf_counter(), print if os.environ.get("RANK", "0") == "0" else (lambda *_: None)
    overrides = {} if torch.cuda.is_available() else cpu_backends.install()
    argv = [*argv, *(f"--{name}={value}" for name, value in overrides.items())]
    script_args, training_args, model_args = parse_train_args(argv)
    folder = Path(f"{training_args.output_dir}-rehearsal")
    scale, notes = _scaled_flags(script_args, training_args, model_args, folder)
    for note in notes:
        say(f"rehearse: {note}")
    unset_hf_deepspeed_config()  # the tiny model is built whole on the main process, not under ZeRO-3's zero.Init
    with training_args.main_process_first(desc="rehearsal inputs"):
        _write_inputs(script_args, scale)
    run_argv = [*argv, *(f"--{name}={value}" for name, value in scale.items())]
    script_args, training_args, model_args = parse_train_args(run_argv)
    if cpu_backends.launcher_kind() == "deepspeed" and overrides:  # DeepSpeed's config checks bf16 against it
        training_args.bf16 = training_args.mixed_precision == "bf16"
    trainer = run_training(script_args, training_args, model_args, end=False)
    report = {"backend": cpu_backends.check_backend(trainer.accelerator), "cpu_overrides": overrides,
              "mixed_precision": trainer.accelerator.mixed_precision, **_sharding(trainer), **_passes(trainer)}
    checkpoint = Path(training_args.output_dir) / f"checkpoint-{scale['save_steps']}"
    report["checkpoint"] = str(checkpoint)
    report["checkpoint_files"] = sorted(path.name for path in checkpoint.iterdir())
    del trainer
    resumed = [*run_argv, f"--resume_from_checkpoint={checkpoint}", f"--output_dir={folder / 'resumed'}"]
    script_args, training_args, model_args = parse_train_args(resumed)
    if cpu_backends.launcher_kind() == "deepspeed" and overrides:
        training_args.bf16 = training_args.mixed_precision == "bf16"
    resumed_trainer = run_training(script_args, training_args, model_args)
    if resumed_trainer.accelerator.is_main_process:
        report["resume_max_abs_difference"] = _max_difference(folder / "run", folder / "resumed")
        report["seconds"] = round(time.perf_counter() - start, 1)
        (folder / "rehearsal.json").write_text(json.dumps(report, indent=2, default=str))
        for key, value in report.items():
            say(f"rehearse: {key}: {value}")
        say(f"rehearse: report {folder / 'rehearsal.json'}; nothing here measures GPU memory or speed")
    return 0


def _scaled_flags(script_args, training_args, model_args, folder: Path) -> tuple[dict[str, Any], list[str]]:
    """The command-line flags that scale a parsed preset down to a rehearsal, and what it says about them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows, per_device = REHEARSAL_SCALE["rows_per_optimizer_step"], REHEARSAL_SCALE["per_device_train_batch_size"]
    per_device = per_device if rows % (per_device * world) == 0 else 1
    if rows % (per_device * world):
        raise CliError(f"rehearse: {world} processes do not divide {rows} completions per optimizer step")
    accumulation = rows // (per_device * world)
    steps_per_pass = training_args.steps_per_generation * training_args.num_iterations
    if steps_per_pass % training_args.gradient_accumulation_steps:
        raise CliError("rehearse: steps_per_generation * num_iterations must be a multiple of gradient_accumulation_steps")
    steps_per_pass //= training_args.gradient_accumulation_steps
    steps_per_generation = steps_per_pass * accumulation // training_args.num_iterations
    flags = {
        "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation,
        "steps_per_generation": steps_per_generation, "max_steps": training_args.lopti_num_passes * steps_per_pass,
        "max_completion_length": REHEARSAL_SCALE["max_completion_length"], "save_strategy": "steps",
        "save_steps": max(1, training_args.lopti_num_passes * steps_per_pass // 2), "eval_strategy": "no", "report_to": "none", "push_to_hub": False,
        "output_dir": folder / "run", "model_name_or_path": _rehearsal_model(model_args.model_name_or_path, folder),
    }  # fmt: skip
    notes = [f"{model_args.model_name_or_path} -> {flags['model_name_or_path']}",
             f"one Lopti cycle = {flags['max_steps']} optimizer steps of {rows} completions, checkpoint after "
             f"{flags['save_steps']}, then a resume from it"]  # fmt: skip
    if training_args.use_vllm:
        flags["use_vllm"] = False
        notes.insert(0, f"vLLM ({training_args.vllm_mode} mode) runs on CUDA GPUs only (server mode: NCCL weight sync):"
                        " NOT rehearsed; completions come from transformers' generate")  # fmt: skip
    if script_args.task == "knights_knaves":
        flags.update(kk_source="generated", kk_num_samples=REHEARSAL_SCALE["prompts"])
        notes.append(f"K&K puzzles generated offline ({script_args.kk_num_people} people), not the preset's data")
    elif script_args.task == "math":
        paper = script_args.dataset_name in _paper_math_files()
        flags["math_data_file" if paper else "dataset_name"] = folder / f"math_problems.{'parquet' if paper else 'jsonl'}"
        notes.append("math: a few local problems, not the preset's data")
    elif not Path(script_args.dataset_name).exists():
        raise CliError(f"rehearse: dataset_name {script_args.dataset_name!r} is not local; rehearsals run offline")
    return flags, notes


def _paper_math_files():
    from ..tasks.math import PAPER_MATH_FILES

    return PAPER_MATH_FILES


def _rehearsal_model(name: str, folder: Path) -> str:
    path = Path(name).expanduser()
    if path.is_dir() and sum(f.stat().st_size for f in path.glob("*.safetensors")) < REHEARSAL_SCALE["max_local_model_bytes"]:
        return str(path)
    model_type = json.loads((path / "config.json").read_text())["model_type"] if path.is_dir() else name.lower()
    family = next((arch for key, arch in FAMILIES.items() if key in model_type), None)
    if family is None:
        raise CliError(f"rehearse: no tiny model for {name!r}; known families: {sorted(FAMILIES)}")
    return str(folder / f"tiny-{family}")


def _write_inputs(script_args, scale: dict[str, Any]) -> None:
    """Writes the tiny model and the local math problems a rehearsal names (once, on the main process first)."""
    from datasets import Dataset

    from ..models import build_tiny_model

    Path(scale["output_dir"]).parent.mkdir(parents=True, exist_ok=True)
    model = Path(scale["model_name_or_path"])
    if model.name.startswith("tiny-") and not (model / "config.json").is_file():
        build_tiny_model(model, architecture=model.name.removeprefix("tiny-"))
    problems = [(f"What is {a} + {b}?", str(a + b)) for a in range(3, 7) for b in range(11, 13)]
    if "math_data_file" in scale and not scale["math_data_file"].is_file():
        rows = [{"prompt": [{"role": "user", "content": f"{q} Let's think step by step and output the final answer "
                 "within \\boxed{}."}], "reward_model": {"ground_truth": a}} for q, a in problems]  # fmt: skip
        Dataset.from_list(rows).to_parquet(scale["math_data_file"])
    elif script_args.task == "math" and not scale["dataset_name"].is_file():
        Dataset.from_list([{script_args.math_problem_column: q, script_args.math_answer_column: a}
                           for q, a in problems]).to_json(scale["dataset_name"])  # fmt: skip


def _local_numel(tensor) -> int:
    if hasattr(tensor, "ds_tensor"):  # ZeRO-3: this process's partition, or all of a "persistent" parameter
        return tensor.ds_numel if getattr(tensor, "ds_persist", False) else tensor.ds_tensor.numel()
    return tensor.to_local().numel() if hasattr(tensor, "to_local") else tensor.numel()


def _sharding(trainer) -> dict[str, Any]:
    """What each process holds: parameters and the optimizer's tensors and state (gathered from every process)."""
    from accelerate.utils import gather_object

    parameters = list(trainer.model.parameters())
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):  # accelerate's and DeepSpeed's wrappers around the torch optimizer
        optimizer = optimizer.optimizer
    # the optimized tensors: its parameter groups' (ZeRO-3 empties them between steps) and those it holds state for
    optimized = list({id(t): t for t in [*(t for g in optimizer.param_groups for t in g["params"]), *optimizer.state]}.values())
    state = [value for tensor in optimized for value in optimizer.state.get(tensor, {}).values() if value.dim()]
    local = {
        "parameter_types": sorted({type(p).__name__ + ("(ZeRO-3)" if hasattr(p, "ds_tensor") else "") for p in parameters}),
        "parameter_dtype": str((parameters[0].ds_tensor if hasattr(parameters[0], "ds_tensor") else parameters[0]).dtype),
        "parameter_elements": sum(_local_numel(p) for p in parameters),
        "optimizer": type(optimizer).__name__,
        "optimizer_elements": sum(_local_numel(t) for t in optimized),
        "optimizer_dtype": str(optimized[0].dtype),
        "optimizer_state_elements": sum(_local_numel(s) for s in state),
        "optimizer_state_dtype": str(state[0].dtype) if state else None,
    }  # fmt: skip
    total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in parameters)
    return {"model_elements": total, "per_process": gather_object([local])}


def _passes(trainer) -> dict[str, Any]:
    """Which optimizer steps trained which token group, the eta and the low-token share, from the logs."""
    history = [entry for entry in trainer.state.log_history if "step" in entry]
    passes = {group: [entry["step"] for entry in history if f"lopti/loss_{group}_pass" in entry] for group in ("low", "high")}
    shares = [entry["lopti/low_token_share"] for entry in history if "lopti/low_token_share" in entry]
    etas = [entry["lopti/threshold"] for entry in history if "lopti/threshold" in entry]
    return {"steps_of_pass": passes, "eta": etas, "low_token_share": shares, "optimizer_steps": trainer.state.global_step}


def _max_difference(first: Path, second: Path) -> float:
    from safetensors.torch import load_file

    one, two = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    if one.keys() != two.keys():
        raise RuntimeError(f"rehearse: the resumed model has other tensors than the uninterrupted one")
    return max(float((one[name].double() - two[name].double()).abs().max()) for name in one)
