"""The shipped accelerate configs, started as users start them, on 2 CPU processes (gloo).

Every file of `configs/accelerate/` but `vllm_server.yaml` runs
`accelerate launch --config_file <the file> --num_processes 2 -m trl_lopti train --config <preset-shaped YAML>
--rehearse`. `vllm_server.yaml` is not run: TRL's vLLM server mode syncs weights to the server over NCCL, which needs
CUDA GPUs. The preset-shaped YAML is `configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml` (AR, Lopti, KL, bnpo, clipping,
gradient checkpointing, constant schedule) with the changes of `TEST_SETTINGS`, and the rehearsal scales it down
(`trl_lopti.cli.rehearse.REHEARSAL_SCALE`): one Lopti cycle (2 optimizer steps per pass), a checkpoint after the low
pass, the final save, and a resume from the checkpoint. What a CPU forces is `trl_lopti.cli.cpu_backends.CPU_OVERRIDES`
and nothing else. The instrumentation (one fixed generation batch, the records of what each process holds) is
`tests/launcher_probe.py`, which states what it patches and why.

Each launcher asserts (a) its backend (from the processes' own objects), (b) that 2 processes equal 1 process on the
same completions, (d) that the checkpoint taken between the passes resumes to the parameters of the uninterrupted run;
the rehearsal of the real preset under the shipped `fsdp2.yaml` asserts (c): bf16 mixed precision keeps float32 sharded
parameters and AdamW state. Run with `-s` to see one JSON row per launcher (also written to
`$TRL_LOPTI_LAUNCHER_REPORT` when set).
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import assert_parameters_close, threshold_between_values
from trl_lopti.cli.cpu_backends import CPU_OVERRIDES
from trl_lopti.cli.rehearse import REHEARSAL_SCALE


ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml"
LAUNCHERS = {"fsdp2.yaml": "FSDP", "fsdp2_offload.yaml": "FSDP", "zero2.yaml": "DEEPSPEED",
             "zero3.yaml": "DEEPSPEED", "multi_gpu.yaml": "MULTI_CPU"}  # fmt: skip
NOT_RUN = {"vllm_server.yaml": "vLLM server mode: weight sync over NCCL needs CUDA GPUs"}

TEST_SETTINGS = {
    # a float64 model (conftest's) without mixed precision: two correct runs agree to ~1e-15 (launch: LAUNCH_FLAGS)
    "dtype": "auto", "bf16": False,
    # SGD with momentum and a large step instead of AdamW at 1e-6: the parameters move far and a wrong gradient shows
    # (AdamW's first steps are sign(gradient) * lr); the momentum is optimizer state that the backends must shard
    "optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05,
    # the fixed generation batch of launcher_probe; eta (set per batch) lies half-way in a wide gap of its pi_old
    "reward_funcs": ["launcher_probe.fixed_batch_reward"],
}  # fmt: skip
LAUNCH_FLAGS = ["--num_processes", "2", "--mixed_precision", "no"]
PROMPT_LENGTH, COMPLETION_LENGTH = 4, 8
EXACT, RESUMED_EXACT = 1e-8, 1e-12
# DeepSpeed's fp32 masters (ZeRO-3 casts the float64 model to fp32): 2 vs 1 processes to 1e-3 of how far each tensor
# moved, plus 2 fp32 rounding steps of a value at 1 (the norm weights start at 1: 2 * 2**-23 = 2.4e-7)
DEEPSPEED_RELATIVE, DEEPSPEED_ATOL = 1e-3, 2.4e-7
REPORT = os.environ.get("TRL_LOPTI_LAUNCHER_REPORT")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command: list[str], cwd: Path, **environment) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **environment)  # fmt: skip
    start = time.perf_counter()
    completed = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    return time.perf_counter() - start


def load_parameters(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {name: tensor.double() for name, tensor in load_file(folder / "model.safetensors").items()}


def fixed_generation_batch(model_path: str, rows: int, temperature: float) -> tuple[dict, float]:
    """A generation batch as TRL's `_generate_and_score_completions` returns it, and an eta far from its pi_old."""
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    completion_mask = torch.ones(rows, COMPLETION_LENGTH, dtype=torch.long)
    completion_mask[::3, 5:] = 0  # padding in some rows
    vocab = model.config.vocab_size
    batch = {
        "prompt_ids": torch.randint(3, vocab, (rows, PROMPT_LENGTH), generator=generator),
        "prompt_mask": torch.ones(rows, PROMPT_LENGTH, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (rows, COMPLETION_LENGTH), generator=generator),
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=generator, dtype=torch.float64),
        "num_items_in_batch": completion_mask.sum(),
    }
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.cat([batch["prompt_mask"], completion_mask], dim=1)).logits
    logps = (logits[:, PROMPT_LENGTH - 1 : -1] / temperature).log_softmax(-1)
    logps = logps.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return batch, float(torch.tensor(threshold_between_values(logps[completion_mask.bool()])).exp())


@pytest.fixture(scope="module")
def setup(tiny_float64_model_path, tmp_path_factory):
    """The preset-shaped config and fixed batch, and the uninterrupted 1-process rehearsal of it (the reference)."""
    folder = tmp_path_factory.mktemp("launchers")
    preset = yaml.safe_load(PRESET.read_text())
    steps_per_pass = preset["steps_per_generation"] * preset["num_iterations"] // preset["gradient_accumulation_steps"]
    rows = REHEARSAL_SCALE["rows_per_optimizer_step"] * steps_per_pass
    batch, eta = fixed_generation_batch(tiny_float64_model_path, rows, preset["temperature"])
    torch.save(batch, folder / "batch.pt")
    config = {**preset, **TEST_SETTINGS, "lopti_threshold": eta, "model_name_or_path": tiny_float64_model_path}
    setup = {"folder": folder, "config": config, "initial": load_parameters(Path(tiny_float64_model_path))}
    reference = launch(setup, None)
    setup["reference"] = load_parameters(reference / "run")
    return setup


def launch(setup: dict, launcher: str | None, launcher_file: Path | None = None) -> Path:
    """Rehearses the config under `launcher` on 2 processes (None: 1 process, no launcher); returns the output root."""
    name = launcher or "one_process"
    output = setup["folder"] / name.removesuffix(".yaml")
    probe = output.parent / f"{output.name}-probe"
    probe.mkdir()
    config = output.parent / f"{output.name}.yaml"
    config.write_text(yaml.safe_dump({**setup["config"], "output_dir": str(output)}))
    train = ["-m", "trl_lopti", "train", "--config", str(config), "--rehearse"]
    command = [sys.executable, *train]
    if launcher is not None:
        launcher_file = launcher_file or ROOT / "configs/accelerate" / launcher
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher_file),
                   *LAUNCH_FLAGS, "--main_process_port", str(free_port()), *train]  # fmt: skip
    seconds = run(command, setup["folder"], LAUNCHER_PROBE_BATCH=str(setup["folder"] / "batch.pt"),
                  LAUNCHER_PROBE_OUT=str(probe))  # fmt: skip
    (probe / "seconds").write_text(str(seconds))
    return Path(f"{output}-rehearsal")


def probe_records(rehearsal: Path) -> dict[str, list[dict]]:
    probe = rehearsal.parent / f"{rehearsal.name.removesuffix('-rehearsal')}-probe"
    return {run: [json.loads((probe / f"{run}_rank{rank}.json").read_text()) for rank in range(2)]
            for run in ("run", "resumed")}  # fmt: skip


def assert_backend(launcher: str, ranks: list[dict]) -> str:
    """(a): what each process's own objects show; returns how it was asserted."""
    expected = LAUNCHERS[launcher]
    total = ranks[0]["parameter_elements"]
    for facts in ranks:
        assert facts["distributed_type"] == f"DistributedType.{expected}" and facts["num_processes"] == 2, facts
    params = [facts["parameter_elements_local"] for facts in ranks]
    optimizer = [facts["optimizer_elements_local"] for facts in ranks]
    states = [facts["optimizer_state_elements_local"] for facts in ranks]
    if expected == "FSDP":
        assert all(facts["parameter_classes"] == ["DTensor"] for facts in ranks)
        assert sum(params) == total and max(params) < total  # Shard(0): every element on exactly one process
        assert optimizer == params and states == params  # SGD momentum lives on the same shards
        if "offload" in launcher:
            assert all(facts["offload_policy"] == ["CPUOffloadPolicy(pin_memory=False)"] for facts in ranks)
        offload = ", offloaded (CPUOffloadPolicy, unpinned)" if "offload" in launcher else ""
        return f"FSDP, DTensor parameters, {params} of {total} elements per process{offload}"
    if expected == "DEEPSPEED":
        partition = [facts["zero_stage"] for facts in ranks]
        assert max(optimizer) < total <= sum(optimizer) and states == optimizer  # fp32 masters + momentum: partitioned
        if launcher == "zero3.yaml":
            assert partition == [3, 3] and all(facts["zero3_partitioned"] for facts in ranks)
            assert max(params) < total <= sum(params)
        else:
            assert partition == [2, 2] and params == [total, total]
        return (f"ZeRO-{partition[0]}, fp32 master partitions {optimizer} of {total}"
                + (f", parameters partitioned {params}" if launcher == "zero3.yaml" else ", parameters replicated"))
    assert all(facts["wrapped_class"] == "DistributedDataParallel" for facts in ranks)
    assert params == [total, total]
    return "MULTI_CPU (gloo DDP), DistributedDataParallel, replicated"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_launcher_trains_one_lopti_cycle_as_one_process_and_resumes_mid_cycle(setup, launcher, tmp_path):
    launcher_file = None
    if launcher == "zero3.yaml":  # the test's copy: tiny parameters would otherwise all stay "persistent" (unsharded)
        launcher_file = zero3_copy_with_every_parameter_sharded(tmp_path)
    rehearsal = launch(setup, launcher, launcher_file)
    records = probe_records(rehearsal)
    backend = assert_backend(launcher, records["run"])
    report = json.loads((rehearsal / "rehearsal.json").read_text())
    assert report["steps_of_pass"] == {"low": [1, 2], "high": [3, 4]} and report["eta"] == [setup["config"]["lopti_threshold"]]
    assert 0.0 < report["low_token_share"][0] < 1.0  # both passes trained tokens
    # (b) 2 processes equal 1 process on the same completions
    run, resumed = load_parameters(rehearsal / "run"), load_parameters(rehearsal / "resumed")
    deepspeed = LAUNCHERS[launcher] == "DEEPSPEED"
    difference, moved = assert_parameters_close(run, setup["reference"], setup["initial"],
                                                atol=DEEPSPEED_ATOL if deepspeed else EXACT,
                                                relative_to_move=DEEPSPEED_RELATIVE if deepspeed else 0.0)  # fmt: skip
    assert moved > 1.0  # far more than any tolerance above
    # (d) the checkpoint after the low pass resumes into the high pass of the stored batch, to the same parameters
    assert [facts["generations"] for facts in records["run"]] == [1, 1]
    assert [facts["generations"] for facts in records["resumed"]] == [0, 0]  # replayed, not regenerated
    assert all(facts["step_at_start"] == 2 * facts["micro_steps_per_optimizer_step"] for facts in records["resumed"])
    assert all(f"lopti_generation_batch_rank{rank}.pt" in report["checkpoint_files"] for rank in range(2))
    resume_difference, _ = assert_parameters_close(resumed, run, setup["initial"], atol=RESUMED_EXACT)
    row = {
        "launcher": launcher, "ran": True, "backend": backend, "max_2_vs_1_difference": difference,
        "parameters_moved": moved, "resume_difference": resume_difference,
        "parameter_dtype": records["run"][0]["parameter_dtypes"],
        "optimizer_state_dtype": records["run"][0]["optimizer_state_dtypes"],
        "seconds": round(float((rehearsal.parent / f"{launcher.removesuffix('.yaml')}-probe" / "seconds").read_text()), 1),
    }  # fmt: skip
    print(json.dumps(row))
    if REPORT:
        with open(REPORT, "a") as report_file:
            report_file.write(json.dumps(row) + "\n")


def zero3_copy_with_every_parameter_sharded(folder: Path) -> Path:
    """zero3.yaml with its DeepSpeed settings in a DeepSpeed config file that adds stage3_param_persistence_threshold 0."""
    shipped = yaml.safe_load((ROOT / "configs/accelerate/zero3.yaml").read_text())
    ds = shipped["deepspeed_config"]
    deepspeed_config = {
        "zero_optimization": {"stage": ds["zero_stage"], "offload_optimizer": {"device": ds["offload_optimizer_device"]},
                              "offload_param": {"device": ds["offload_param_device"]},
                              "stage3_gather_16bit_weights_on_model_save": ds["zero3_save_16bit_model"],
                              "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": "auto"}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    }  # fmt: skip
    (folder / "zero3_ds.json").write_text(json.dumps(deepspeed_config))
    shipped["deepspeed_config"] = {"deepspeed_config_file": str(folder / "zero3_ds.json"),
                                   "zero3_init_flag": ds["zero3_init_flag"],
                                   "deepspeed_multinode_launcher": ds["deepspeed_multinode_launcher"]}  # fmt: skip
    path = folder / "zero3.yaml"
    path.write_text(yaml.safe_dump(shipped))
    return path


def test_every_shipped_launcher_is_tested_or_excluded_with_a_reason():
    shipped = {path.name for path in (ROOT / "configs/accelerate").glob("*.yaml")}
    assert shipped == set(LAUNCHERS) | set(NOT_RUN)
    assert set(CPU_OVERRIDES) == {"fsdp_or_ddp", "deepspeed"}


@pytest.mark.slow
def test_rehearsal_of_a_3b_preset_under_the_shipped_fsdp2_launcher(tmp_path):
    """The README's command as is: (c) bf16 mixed precision keeps float32 sharded parameters and AdamW state."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/fsdp2.yaml"), "--num_processes", "2", "--main_process_port",
               str(free_port()), "-m", "trl_lopti", "train", "--config", str(PRESET), "--rehearse"]  # fmt: skip
    seconds = run(command, tmp_path)
    report = json.loads((tmp_path / "outputs/kk_qwen2.5-3b-instruct_ar_lopti-rehearsal/rehearsal.json").read_text())
    assert report["backend"].startswith("FSDP on 2 process") and report["mixed_precision"] == "bf16"
    assert report["cpu_overrides"] == CPU_OVERRIDES["fsdp_or_ddp"]
    held = report["per_process"]
    assert sum(process["parameter_elements"] for process in held) == report["model_elements"]
    for process in held:
        assert process["parameters"] == ["DTensor"] and process["parameter_dtype"] == "torch.float32"
        assert process["optimizer"] == "AdamW" and process["optimizer_dtype"] == "torch.float32"
        assert process["optimizer_elements"] == process["parameter_elements"] < report["model_elements"]
        # exp_avg and exp_avg_sq, sharded as the parameters, in float32
        assert process["optimizer_state_elements"] == 2 * process["parameter_elements"]
        assert process["optimizer_state_dtype"] == "torch.float32"
    assert report["steps_of_pass"] == {"low": [1, 2], "high": [3, 4]} and report["eta"] == [0.5]
    assert {"lopti_generation_batch_rank0.pt", "lopti_generation_batch_rank1.pt"} <= set(report["checkpoint_files"])
    assert report["resume_max_abs_difference"] == 0.0
    print(json.dumps({"launcher": "fsdp2.yaml (rehearsal of the preset, shipped bf16)", "ran": True,
                      "parameter_dtype": held[0]["parameter_dtype"], "optimizer_state_dtype": held[0]["optimizer_state_dtype"],
                      "resume_difference": report["resume_max_abs_difference"], "seconds": round(seconds, 1)}))  # fmt: skip


@pytest.mark.slow
def test_rehearsal_of_a_math_preset_writes_local_problems_in_the_authors_format(tmp_path):
    command = [sys.executable, "-m", "trl_lopti", "train", "--config",
               str(ROOT / "configs/math/qwen2.5-7b_dsr_uniform_lopti.yaml"), "--rehearse"]  # fmt: skip
    run(command, tmp_path)
    folder = tmp_path / "outputs/math_qwen2.5-7b_dsr_uniform_lopti-rehearsal"
    report = json.loads((folder / "rehearsal.json").read_text())
    assert (folder / "math.parquet").is_file() and (folder / "tiny-qwen2/config.json").is_file()
    assert report["backend"].startswith("NO on 1 process") and report["steps_of_pass"]["high"] == [3, 4]


def test_rehearsal_of_the_vllm_server_preset_says_at_once_what_it_does_not_run(tmp_path):
    from trl_lopti.cli.rehearse import _scaled_flags
    from trl_lopti.cli.train import parse_train_args

    preset = ROOT / "configs/vllm/qwen2.5-3b-instruct_ar_lopti_server.yaml"
    said = []
    parsed = parse_train_args(["--config", str(preset), "--use_cpu", "true"])
    flags = _scaled_flags(*parsed, tmp_path, said.append)
    assert flags["use_vllm"] is False and "NOT rehearsed" in said[0] and "NCCL" in said[0]
    assert flags["model_name_or_path"] == str(tmp_path / "tiny-qwen2") and flags["kk_source"] == "generated"
