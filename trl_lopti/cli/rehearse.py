"""`trl-lopti train --rehearse`: a preset's launch rehearsed on CPU processes, before paying for GPUs.

`accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 -m trl_lopti train --config
configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml --rehearse` runs the preset's launcher (backend, processes, mixed
precision), parser, task, reward and trainer settings offline with a tiny random model of the preset's family (a local
model under 100 MB as it is) and a few prompts of its task (`REHEARSAL_SCALE`): one Lopti cycle with a checkpoint after
the first pass and the final save, then a resume from that checkpoint as `--resume_from_checkpoint` runs it. It prints
what it verified and measures no GPU memory or speed. Without a GPU the backend runs on gloo (`cpu_backends`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .errors import CliError


REHEARSAL_SCALE = {"rows_per_optimizer_step": 8, "per_device_train_batch_size": 2, "max_completion_length": 16,
                   "prompts": 32, "max_local_model_bytes": 100e6}  # fmt: skip
"""What a rehearsal shrinks: completions per optimizer step (all processes), micro-batch, completion length, prompts,
the size of a local model used as it is. The optimizer steps per generation batch, the group size and every method,
loss, optimizer and precision setting stay the preset's; evaluation, trackers and hub uploads are off."""

FAMILIES = {"qwen": "qwen2", "llama": "llama", "smollm": "llama"}
"""Tiny model architecture (`trl_lopti.models.build_tiny_model`) by a part of the model's name or `model_type`."""


def main(argv: list[str]) -> int:
    """Rehearses `trl-lopti train ARGV` (the arguments after `train`, with `--rehearse`); returns the exit code."""
    import torch
    from safetensors.torch import load_file
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from . import cpu_backends
    from .train import parse_train_args, run_training

    start, say = time.perf_counter(), print if os.environ.get("RANK", "0") == "0" else (lambda *_: None)
    overrides = {} if torch.cuda.is_available() else cpu_backends.install()

    def parse(*flags: dict[str, Any]):
        parsed = parse_train_args([*argv, *(f"--{k}={v}" for f in (overrides, *flags) for k, v in f.items())])
        if overrides and cpu_backends.launcher_kind() == "deepspeed":  # DeepSpeed's config checks bf16 against it
            parsed[1].bf16 = parsed[1].mixed_precision == "bf16"
        return parsed

    script_args, training_args, model_args = parse()
    folder = Path(f"{training_args.output_dir}-rehearsal")
    scale = _scaled_flags(script_args, training_args, model_args, folder, say)
    unset_hf_deepspeed_config()  # the tiny model is built whole on the main process, not under ZeRO-3's zero.Init
    with training_args.main_process_first(desc="rehearsal inputs"):
        _write_inputs(script_args, scale)
    trainer = run_training(*parse(scale), end=False)
    report = {"backend": cpu_backends.check_backend(trainer.accelerator), "cpu_overrides": overrides,
              "mixed_precision": trainer.accelerator.mixed_precision, **_holdings(trainer), **_passes(trainer)}
    checkpoint = folder / "run" / f"checkpoint-{scale['save_steps']}"
    report.update(checkpoint=str(checkpoint), checkpoint_files=sorted(path.name for path in checkpoint.iterdir()))
    del trainer
    resumed = run_training(*parse(scale, {"resume_from_checkpoint": checkpoint, "output_dir": folder / "resumed"}))
    if resumed.accelerator.is_main_process:
        run, rerun = (load_file(folder / name / "model.safetensors") for name in ("run", "resumed"))
        assert run.keys() == rerun.keys(), "rehearse: the resumed model holds other tensors"
        report["resume_max_abs_difference"] = max(float((run[k].double() - rerun[k].double()).abs().max()) for k in run)
        report["seconds"] = round(time.perf_counter() - start, 1)
        (folder / "rehearsal.json").write_text(json.dumps(report, indent=2, default=str))
        _print_report(report, say)
        say(f"rehearse: report {folder / 'rehearsal.json'}. Nothing here measures GPU memory or speed.")
    return 0


def _scaled_flags(script_args, training_args, model_args, folder: Path, say) -> dict[str, Any]:
    """The flags that scale a parsed preset down to a rehearsal; says what they change."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows, per_device = REHEARSAL_SCALE["rows_per_optimizer_step"], REHEARSAL_SCALE["per_device_train_batch_size"]
    per_device = per_device if rows % (per_device * world) == 0 else 1
    micro_steps, accumulation = training_args.steps_per_generation * training_args.num_iterations, rows // per_device
    if rows % (per_device * world) or micro_steps % training_args.gradient_accumulation_steps:
        raise CliError(f"rehearse: needs 1, 2, 4 or 8 processes (got {world}) and steps_per_generation * "
                       "num_iterations a multiple of gradient_accumulation_steps")  # fmt: skip
    accumulation, steps_per_pass = accumulation // world, micro_steps // training_args.gradient_accumulation_steps
    max_steps = training_args.lopti_num_passes * steps_per_pass
    flags = {
        "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation,
        "steps_per_generation": steps_per_pass * accumulation // training_args.num_iterations, "max_steps": max_steps,
        "max_completion_length": REHEARSAL_SCALE["max_completion_length"], "save_strategy": "steps",
        "save_steps": max(1, max_steps // 2), "eval_strategy": "no", "report_to": "none", "push_to_hub": False,
        "output_dir": folder / "run", "model_name_or_path": _rehearsal_model(model_args.model_name_or_path, folder),
    }  # fmt: skip
    if training_args.use_vllm:
        flags["use_vllm"] = False
        say(f"rehearse: vLLM ({training_args.vllm_mode} mode) runs on CUDA GPUs only (server mode syncs weights over "
            "NCCL): NOT rehearsed; completions come from transformers' generate")  # fmt: skip
    say(f"rehearse: model {model_args.model_name_or_path} -> {flags['model_name_or_path']}")
    if script_args.task == "knights_knaves":
        flags.update(kk_source="generated", kk_num_samples=REHEARSAL_SCALE["prompts"])
        say(f"rehearse: data: {REHEARSAL_SCALE['prompts']} K&K puzzles generated offline ({script_args.kk_num_people} "
            "people), not the preset's")  # fmt: skip
    elif script_args.task == "math":
        from ..tasks.math import PAPER_MATH_FILES

        if script_args.dataset_name not in PAPER_MATH_FILES:
            raise CliError(f"rehearse: math set {script_args.dataset_name!r} loads from a hub; a rehearsal runs offline "
                           f"on one of {sorted(PAPER_MATH_FILES)} (a local copy in the authors' format)")
        flags["math_data_file"] = folder / "math.parquet"
        say("rehearse: data: 8 local addition problems, not the preset's")
    elif not Path(script_args.dataset_name).exists():
        raise CliError(f"rehearse: dataset_name {script_args.dataset_name!r} is not local; a rehearsal runs offline")
    say(f"rehearse: schedule: {max_steps} optimizer steps of {rows} completions on {world} process(es) "
        f"({per_device} x {accumulation} micro-steps), checkpoint after step {flags['save_steps']}, then a resume")
    return flags


def _rehearsal_model(name: str, folder: Path) -> str:
    path = Path(name).expanduser()
    weights = sum(file.stat().st_size for file in path.glob("*.safetensors")) if path.is_dir() else None
    if weights is not None and weights < REHEARSAL_SCALE["max_local_model_bytes"]:
        return str(path)
    model_type = json.loads((path / "config.json").read_text())["model_type"] if path.is_dir() else name.lower()
    family = next((arch for key, arch in FAMILIES.items() if key in model_type), None)
    if family is None:
        raise CliError(f"rehearse: no tiny model of the family of {name!r}; known: {sorted(FAMILIES)}")
    return str(folder / f"tiny-{family}")


def _write_inputs(script_args, scale: dict[str, Any]) -> None:
    """Writes what the flags name and nothing holds yet: the tiny model, the local math problems."""
    from datasets import Dataset

    from ..models import build_tiny_model

    Path(scale["output_dir"]).parent.mkdir(parents=True, exist_ok=True)
    model = Path(scale["model_name_or_path"])
    if model.name.startswith("tiny-") and not (model / "config.json").is_file():
        build_tiny_model(model, architecture=model.name.removeprefix("tiny-"))
    problems = [(f"What is {a} + {b}?", str(a + b)) for a in range(3, 7) for b in range(11, 13)]
    if "math_data_file" in scale and not scale["math_data_file"].is_file():  # the authors' parquet layout
        rows = [{"prompt": [{"role": "user", "content": f"{q} Let's think step by step and output the final answer "
                 "within \\boxed{}."}], "reward_model": {"ground_truth": a}} for q, a in problems]  # fmt: skip
        Dataset.from_list(rows).to_parquet(scale["math_data_file"])


def _holdings(trainer) -> dict[str, Any]:
    """What each process holds of the parameters and of the optimizer's tensors and state (from every process)."""
    from accelerate.utils import gather_object

    def local(tensor) -> int:  # ZeRO-3: its partition, or all of a "persistent" parameter; FSDP2: the DTensor shard
        if hasattr(tensor, "ds_tensor"):
            return tensor.ds_numel if getattr(tensor, "ds_persist", False) else tensor.ds_tensor.numel()
        return tensor.to_local().numel() if hasattr(tensor, "to_local") else tensor.numel()

    parameters, optimizer = list(trainer.model.parameters()), trainer.optimizer
    while hasattr(optimizer, "optimizer"):  # accelerate's and DeepSpeed's wrappers around the torch optimizer
        optimizer = optimizer.optimizer
    # its parameter groups' tensors (ZeRO-3 empties them between steps) and those it holds state for
    optimized = list({id(t): t for t in [*(t for g in optimizer.param_groups for t in g["params"]), *optimizer.state]}
                     .values())  # fmt: skip
    state = [value for tensor in optimized for value in optimizer.state.get(tensor, {}).values() if value.dim()]
    held = {
        "parameters": sorted({type(p).__name__ + (" (ZeRO-3)" if hasattr(p, "ds_tensor") else "") for p in parameters}),
        "parameter_dtype": str(getattr(parameters[0], "ds_tensor", parameters[0]).dtype),
        "parameter_elements": sum(map(local, parameters)), "optimizer": type(optimizer).__name__,
        "optimizer_elements": sum(map(local, optimized)), "optimizer_dtype": str(optimized[0].dtype),
        "optimizer_state_elements": sum(map(local, state)),
        "optimizer_state_dtype": str(state[0].dtype) if state else None,
    }  # fmt: skip
    total = sum(getattr(p, "ds_numel", p.numel()) for p in parameters)
    return {"model_elements": total, "per_process": gather_object([held])}


def _passes(trainer) -> dict[str, Any]:
    """Which optimizer steps trained which token group, the eta and the low-token share, from the logs."""
    logs = [entry for entry in trainer.state.log_history if "step" in entry]
    steps = {group: [e["step"] for e in logs if f"lopti/loss_{group}_pass" in e] for group in ("low", "high")}
    values = {key: [e[f"lopti/{key}"] for e in logs if f"lopti/{key}" in e] for key in ("threshold", "low_token_share")}
    return {"steps_of_pass": steps, "eta": values["threshold"], "low_token_share": values["low_token_share"]}


def _print_report(report: dict[str, Any], say) -> None:
    say(f"rehearse: backend {report['backend']}, mixed precision {report['mixed_precision']}, "
        f"CPU overrides {report['cpu_overrides'] or 'none'}")  # fmt: skip
    for rank, held in enumerate(report["per_process"]):
        say(f"rehearse: process {rank}: parameters {'/'.join(held['parameters'])} {held['parameter_dtype']}, "
            f"{held['parameter_elements']:,} of {report['model_elements']:,} elements; {held['optimizer']} over "
            f"{held['optimizer_elements']:,} {held['optimizer_dtype']} elements, state "
            f"{held['optimizer_state_elements']:,} {held['optimizer_state_dtype']}")  # fmt: skip
    say(f"rehearse: passes: low tokens at optimizer steps {report['steps_of_pass']['low']}, high tokens at "
        f"{report['steps_of_pass']['high']}; eta {report['eta']}; low-token share {report['low_token_share']}")
    if any(share in (0.0, 1.0) for share in report["low_token_share"]):
        say("rehearse: one pass had no active token (a random tiny model's probabilities lie on one side of eta): "
            "it stepped with a zero gradient, as the authors' runs do")  # fmt: skip
    batches = [name for name in report["checkpoint_files"] if name.startswith("lopti_generation_batch")]
    say(f"rehearse: checkpoint {report['checkpoint']} (with {', '.join(batches) or 'no generation batch'}); resumed "
        f"from it to the final step: largest parameter difference to the uninterrupted run "
        f"{report['resume_max_abs_difference']:.3g}; {report['seconds']} s")  # fmt: skip
