"""`trl-lopti`: parsing (YAML + flags, `None`), errors that name the file or field (exit code 2), the datasets of each
task, and real training runs from a YAML file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from trl_lopti.cli import CliError
from trl_lopti.cli.train import build_datasets, parse_train_args, run_training


REPO = Path(__file__).resolve().parents[1]


def write_yaml(path: Path, values: dict) -> str:
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.fixture
def base(tmp_path, tiny_model_path):
    """The smallest valid config: a local model, CPU, an output folder."""
    return {"model_name_or_path": tiny_model_path, "output_dir": str(tmp_path / "out"), "use_cpu": True}


def test_usage_version_and_unknown_command(run_cli):
    from trl_lopti import __version__

    code, out, _ = run_cli([])  # `trl-lopti` alone lists the commands
    assert code == 0 and all(f"\n  {command} " in out for command in ("train", "demo", "diagnose"))
    code, _, err = run_cli(["trian"])
    assert code == 2 and "'trian'" in err
    assert run_cli(["--version"])[:2] == (0, f"trl-lopti {__version__}\n")
    code, out, _ = run_cli(["train", "--help"])
    assert code == 0 and "--lopti_threshold" in out and "--kk_source" in out


@pytest.mark.parametrize("command", ["train", "diagnose"])
def test_a_command_without_arguments_says_what_it_needs_with_an_example(run_cli, command):
    """What `make demo` does to `demo` (tests/test_demo.py): the command with an empty argument list."""
    code, out, err = run_cli([command])
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"trl-lopti {command}: error: needs ") and f"\n  trl-lopti {command} --" in err, err


def test_python_dash_m_runs_the_cli(tmp_path, base):
    """`python -m trl_lopti` (what `accelerate launch -m trl_lopti` runs) reaches the same CLI."""
    config = write_yaml(tmp_path / "c.yaml", {**base, "lopti_threshold": None})
    result = subprocess.run(
        [sys.executable, "-m", "trl_lopti", "train", "--config", config, "--dry_run", "--learning_rate", "3e-6"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout[result.stdout.index("{\n") :])  # after any banner a library prints on import
    assert resolved["training"]["learning_rate"] == 3e-6 and resolved["lopti"]["lopti_threshold"] is None
    assert resolved["model"]["model_name_or_path"] == base["model_name_or_path"]


def test_yaml_values_and_flags_override_them(tmp_path, base):
    values = {
        **base,
        "learning_rate": "1e-6",
        "advantage_reweighting_alpha": 0.2,
        "kk_num_people": [3, 4],
        "use_peft": True,
        "lora_r": 4,
        "lopti_threshold": 0.5,
    }
    config = write_yaml(tmp_path / "c.yaml", values)  # YAML 1.1 reads 1e-6 as a string: the field's type converts it
    script_args, training_args, model_args = parse_train_args(["--config", config])
    assert isinstance(training_args.learning_rate, float) and training_args.learning_rate == 1e-6
    assert training_args.advantage_reweighting_alpha == 0.2 and training_args.lopti_threshold == 0.5
    assert script_args.kk_num_people == [3, 4] and model_args.use_peft is True and model_args.lora_r == 4
    script_args, training_args, model_args = parse_train_args(
        ["--config", config, "--lopti_threshold", "0.4", "--lora_r", "8", "--kk_num_people", "5"]
    )
    assert training_args.lopti_threshold == 0.4 and model_args.lora_r == 8 and script_args.kk_num_people == [5]


@pytest.mark.parametrize("spelling", ["None", "none", "null", "NULL"])
def test_none_disables_lopti_from_the_command_line_and_from_yaml_text(tmp_path, base, spelling):
    config = write_yaml(tmp_path / "c.yaml", {**base, "lopti_threshold": 0.5})
    _, training_args, _ = parse_train_args(["--config", config, "--lopti_threshold", spelling])
    assert training_args.lopti_threshold is None and not training_args.lopti_enabled
    config = write_yaml(tmp_path / "text.yaml", {**base, "lopti_threshold": spelling})  # YAML text, not YAML null
    _, training_args, _ = parse_train_args(["--config", config])
    assert training_args.lopti_threshold is None


def test_dry_run_prints_the_resolved_config_and_loads_nothing(tmp_path, base, run_cli):
    config = write_yaml(tmp_path / "c.yaml", {**base, "kk_num_people": [2, 3], "kk_num_samples": 7, "beta": 0.01})
    code, out, err = run_cli(["train", "--config", config, "--dry_run", "--use_peft", "true", "--lora_r", "4"])
    assert code == 0, err
    resolved = json.loads(out)
    assert resolved["reward_funcs"] == ["knights_knaves_reward"]
    assert resolved["script"]["kk_num_people"] == [2, 3] and resolved["script"]["kk_num_samples"] == 7
    assert resolved["model"]["use_peft"] is True and resolved["model"]["lora_r"] == 4
    assert resolved["training"]["beta"] == 0.01 and "learning_rate" not in resolved["training"]  # the default
    assert resolved["lopti"] == {
        "advantage_reweighting_alpha": 0.3,
        "lopti_threshold": 0.5,
        "lopti_quantile": None,
        "lopti_order": "low_first",
        "advantage_estimator": "grpo",
    }
    assert not (tmp_path / "out").exists()


def test_config_file_errors_name_the_file(tmp_path, run_cli):
    missing = tmp_path / "nope.yaml"
    broken = tmp_path / "broken.yaml"
    broken.write_text("learning_rate: [1e-6\nbeta: 0.1\n")
    listing = tmp_path / "list.yaml"
    listing.write_text("- learning_rate\n- beta\n")
    for path in (missing, broken, listing):
        code, _, err = run_cli(["train", "--config", str(path)])
        assert code == 2 and str(path) in err, err
    code, _, err = run_cli(["train", "--config"])
    assert code == 2 and "--config" in err


@pytest.mark.parametrize(
    "values, field",
    [
        ({"learnig_rate": 1e-6}, "learnig_rate"),  # an unknown key
        ({"learning_rate": "fast"}, "learning_rate"),
        ({"advantage_reweighting_alpha": 1.5}, "advantage_reweighting_alpha"),
        ({"task": "sudoku"}, "task"),
        ({"kk_source": "x"}, "kk_source"),
        ({"kk_num_people": [1]}, "kk_num_people"),
        ({"task": "math", "dataset_name": "gsm8k"}, "dataset_name"),
        ({"task": "dataset", "reward_funcs": ["accuracy_reward"]}, "dataset_name"),
        ({"task": "dataset", "dataset_name": "data.jsonl"}, "reward_funcs"),
        ({"reward_funcs": ["no_such_reward"]}, "reward_funcs"),
        ({"reward_funcs": ["nowhere.reward"]}, "reward_funcs"),
        ({"model_name_or_path": None}, "model_name_or_path"),
        ({"model_name_or_path": "/no/such/model"}, "model_name_or_path"),
    ],
)
def test_bad_values_name_the_field_before_loading_anything(tmp_path, base, run_cli, values, field):
    config = write_yaml(tmp_path / "bad.yaml", {**base, **values})
    code, _, err = run_cli(["train", "--config", config, "--dry_run"])
    assert code == 2 and field in err, err


def test_bad_flags_name_the_flag(tmp_path, base, run_cli):
    config = write_yaml(tmp_path / "ok.yaml", base)
    for flags, name in ((["--task", "sudoku"], "task"), (["--eta", "0.5"], "eta"), (["--beta", "x"], "beta")):
        code, _, err = run_cli(["train", "--config", config, "--dry_run", *flags])
        assert code == 2 and name in err, err


# ---------------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------------
def test_generated_knights_knaves_with_an_eval_split(tmp_path, base):
    values = {**base, "kk_num_people": [2, 3], "kk_num_samples": 6, "kk_num_eval_samples": 3, "eval_strategy": "steps"}
    config = write_yaml(tmp_path / "kk.yaml", values)
    script_args, training_args, _ = parse_train_args(["--config", config])
    train, evaluation = build_datasets(script_args, training_args)
    assert len(train) == 6 and len(evaluation) == 3 and sorted(set(train["num_people"])) == [2, 3]
    assert not set(train["quiz"]) & set(evaluation["quiz"])  # held-out puzzles are new puzzles
    _, no_eval = build_datasets(script_args, parse_train_args(["--config", config, "--eval_strategy", "no"])[1])
    assert no_eval is None


def test_local_data_files_folders_and_saved_datasets(tmp_path, base):
    from datasets import Dataset, DatasetDict

    rows = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(5)]
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    folder = tmp_path / "folder"
    folder.mkdir()
    Dataset.from_list(rows[:2]).to_parquet(str(folder / "train.parquet"))
    Dataset.from_list(rows[2:3]).to_parquet(str(folder / "test.parquet"))
    saved = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(rows[:4]), "test": Dataset.from_list(rows[4:])}).save_to_disk(saved)
    config = {
        **base,
        "task": "dataset",
        "reward_funcs": ["trl_lopti.tasks.arithmetic.exact_answer_reward"],
        "eval_strategy": "steps",
    }
    expected = {data_file: (rows, rows), folder: (rows[:2], rows[2:3]), saved: (rows[:4], rows[4:])}
    for name, (train_rows, eval_rows) in expected.items():
        config_path = write_yaml(tmp_path / "d.yaml", {**config, "dataset_name": str(name)})
        train, evaluation = build_datasets(*parse_train_args(["--config", config_path])[:2])
        assert train.to_list() == train_rows and evaluation.to_list() == eval_rows, name
    # datasets' split slicing keeps part of a split
    argv = ["--config", config_path, "--dataset_name", str(folder), "--dataset_train_split", "train[:1]"]
    assert build_datasets(*parse_train_args(argv)[:2])[0].to_list() == rows[:1]

    (tmp_path / "noprompt.jsonl").write_text(json.dumps({"question": "x"}) + "\n")
    for name, message in (("missing.jsonl", "missing.jsonl"), ("noprompt.jsonl", "prompt")):
        argv = ["--config", config_path, "--dataset_name", str(tmp_path / name)]
        with pytest.raises(CliError, match=message):
            build_datasets(*parse_train_args(argv)[:2])


# ---------------------------------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------------------------------
def test_train_from_yaml_with_lora(tmp_path, base, run_cli):
    """`trl-lopti train --config` trains a tiny model with LoRA, AR and Lopti on a local dataset, and saves it."""
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 2? The answer is", "answer": i + 2}) + "\n" for i in range(4))
    )
    values = {
        **base,
        "task": "dataset",
        "dataset_name": str(data),
        "reward_funcs": ["trl_lopti.tasks.arithmetic.exact_answer_reward"],
        "use_peft": True,
        "lora_r": 4,
        "lora_target_modules": ["q_proj", "v_proj"],
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 4,
        "learning_rate": "1e-3",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "advantage_reweighting_alpha": 0.3,
        "lopti_threshold": 0.5,
    }
    code, _, err = run_cli(["train", "--config", write_yaml(tmp_path / "train.yaml", values)])
    assert code == 0, err
    out_dir = Path(base["output_dir"])
    adapter = json.loads((out_dir / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    assert (out_dir / "adapter_model.safetensors").is_file()


def test_train_knights_knaves_gives_grpo_the_prefilled_think_as_text(tmp_path, base):
    """GRPOTrainer never continues a final assistant message: K&K prompts reach it as text left open at "<think>"."""
    values = {
        **base,
        "kk_num_people": [2],
        "kk_num_samples": 2,
        "kk_prefill_think": True,
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_completion_length": 4,
        "save_strategy": "no",
        "report_to": "none",
    }
    trainer = run_training(*parse_train_args(["--config", write_yaml(tmp_path / "kk.yaml", values)]))
    prompts = trainer.train_dataset["prompt"]
    assert len(prompts) == 2 and all(text.endswith("<|im_start|>assistant\n<think>") for text in prompts)
    assert trainer.state.global_step == 1


# ---------------------------------------------------------------------------------------------------------------------
# Each command on a machine without an accelerator (this one in CI), run as a user runs it: `python -m trl_lopti ...`
# ---------------------------------------------------------------------------------------------------------------------
def run_command(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trl_lopti", *argv], capture_output=True, text=True, cwd=cwd, timeout=600, check=False
    )


def cpu_notices(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "no accelerator on this machine" in line]


SIDE_TOOLS = {  # command -> (extra arguments, the CPU settings it takes, the file it writes under its output folder)
    "demo": (
        ["--rollout_batches", "1", "--per_device_train_batch_size", "4", "--num_generations", "2"]
        + ["--num_eval_pairs", "2", "--eval_samples", "1"],
        "--use_cpu=True --bf16=False",
        "results.json",
    ),
    "diagnose": (
        ["--task", "knights_knaves", "--kk_num_samples", "4", "--num_generations", "2", "--max_completion_length", "6"]
        + ["--per_device_train_batch_size", "4", "--probe_methods", "grpo", "lopti", "--no_plots"],
        "--use_cpu=True",
        "report.json",
    ),
}


@pytest.mark.slow
@pytest.mark.skipif(torch.accelerator.is_available(), reason="what a machine without an accelerator does")
@pytest.mark.parametrize("command", list(SIDE_TOOLS))
def test_side_tools_take_cpu_settings_and_say_so_once(tmp_path, tiny_model_path, command):
    extra, settings, written = SIDE_TOOLS[command]
    output_dir = tmp_path / "out"
    result = run_command(
        command, "--model_name_or_path", tiny_model_path, "--output_dir", str(output_dir), *extra, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert cpu_notices(result.stderr) == [
        f"trl-lopti {command}: no accelerator on this machine, CPU settings: {settings}"
    ]
    assert (output_dir / written).is_file()


@pytest.mark.slow
@pytest.mark.skipif(torch.accelerator.is_available(), reason="what a machine without an accelerator does")
def test_rehearsal_of_a_gpu_preset_takes_cpu_settings_and_says_so_once(tmp_path):
    preset = str(REPO / "configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml")
    result = run_command("train", "--config", preset, "--rehearse", "--output_dir", str(tmp_path / "kk"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert cpu_notices(result.stderr) == [
        "trl-lopti train --rehearse: no accelerator on this machine, CPU settings: --use_cpu=True"
    ]
    assert json.loads((tmp_path / "kk-rehearsal" / "rehearsal.json").read_text())["failures"] == []


@pytest.mark.skipif(torch.accelerator.is_available(), reason="what a machine without an accelerator does")
def test_training_does_not_fall_back_to_the_cpu_and_names_the_flag(tmp_path, tiny_model_path):
    preset = str(REPO / "configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml")
    argv = ["train", "--config", preset, "--model_name_or_path", tiny_model_path, "--output_dir", str(tmp_path / "kk")]
    result = run_command(*argv, cwd=tmp_path)
    assert result.returncode == 2
    assert "use_cpu" in result.stderr and "--use_cpu true" in result.stderr and cpu_notices(result.stderr) == []
    assert not (tmp_path / "kk").exists()


# ---------------------------------------------------------------------------------------------------------------------
# The trainer: GRPO (default) or RLOO, chosen before parsing (`trainer_of`)
# ---------------------------------------------------------------------------------------------------------------------
def test_the_trainer_chooses_the_config_from_yaml_or_a_flag_which_overrides_it(tmp_path, base, run_cli):
    from trl_lopti import LoptiGRPOConfig, LoptiRLOOConfig

    rloo = write_yaml(tmp_path / "rloo.yaml", {**base, "trainer": "rloo", "normalize_advantages": True, "beta": 0.1})
    script_args, training_args, _ = parse_train_args(["--config", rloo])
    assert script_args.trainer == "rloo" and type(training_args) is LoptiRLOOConfig
    assert training_args.normalize_advantages is True and training_args.beta == 0.1
    plain = write_yaml(tmp_path / "plain.yaml", base)
    assert type(parse_train_args(["--config", plain])[1]) is LoptiGRPOConfig  # the default
    script_args, training_args, _ = parse_train_args(["--config", plain, "--trainer", "rloo", "--epsilon_high=0.3"])
    assert (
        script_args.trainer == "rloo" and type(training_args) is LoptiRLOOConfig and training_args.epsilon_high == 0.3
    )
    grpo = write_yaml(tmp_path / "grpo.yaml", {**base, "trainer": "rloo", "beta": 0.1})
    assert type(parse_train_args(["--config", grpo, "--trainer=grpo"])[1]) is LoptiGRPOConfig  # the flag wins
    code, out, err = run_cli(["train", "--config", rloo, "--dry_run"])
    assert code == 0, err
    resolved = json.loads(out)
    assert resolved["trainer"] == "rloo" and resolved["lopti"]["advantage_estimator"] == "rloo"
    assert resolved["training"]["normalize_advantages"] is True and resolved["training"]["beta"] == 0.1
    code, out, _ = run_cli(["train", "--help"])
    assert code == 0 and "--trainer {grpo,rloo}" in out


@pytest.mark.parametrize(
    "values, flags, named",
    [
        ({"trainer": "rloo", "advantage_estimator": "reinforce_plus_plus"}, [], "advantage_estimator: 'reinforce"),
        ({"trainer": "rloo"}, ["--advantage_estimator", "reinforce_plus_plus"], "advantage_estimator: 'reinforce"),
        ({"normalize_advantages": True}, [], "normalize_advantages: a key of LoptiRLOOConfig (trainer: rloo)"),
        ({}, ["--reward_clip_range", "0", "1"], "reward_clip_range: a key of LoptiRLOOConfig (trainer: rloo)"),
        ({"trainer": "rloo", "loss_type": "bnpo"}, [], "loss_type: a key of LoptiGRPOConfig (trainer: grpo)"),
        ({}, ["--trainer", "rloo", "--delta=10"], "delta: a key of LoptiGRPOConfig (trainer: grpo)"),
        ({"trainer": "ppo"}, [], "trainer: must be one of ['grpo', 'rloo'], got 'ppo'"),
        ({}, ["--traine", "rloo"], "write the flag out in full: --trainer rloo"),
    ],
)
def test_a_key_of_the_other_trainer_names_the_key_and_both_configs(tmp_path, base, run_cli, values, flags, named):
    config = write_yaml(tmp_path / "c.yaml", {**base, **values})
    code, _, err = run_cli(["train", "--config", config, "--dry_run", *flags])
    assert code == 2 and named in err, err
    if "advantage_estimator" in named:
        assert "is a value of LoptiGRPOConfig (trainer: grpo); LoptiRLOOConfig (trainer: rloo) takes ['rloo']" in err
    if "a key of" in named:
        assert "has no such key" in err


@pytest.mark.parametrize("command, why", [("diagnose", "diagnose measures GRPO's loss"), ("demo", "the demo is")])
@pytest.mark.parametrize("how", ["yaml", "flag"])
def test_diagnose_and_demo_refuse_rloo_and_say_why(tmp_path, tiny_model_path, run_cli, command, why, how):
    values = {"model_name_or_path": tiny_model_path, "output_dir": str(tmp_path / "out")}
    values |= {"trainer": "rloo", "normalize_advantages": True} if how == "yaml" else {}
    argv = ["--config", write_yaml(tmp_path / "c.yaml", values)] + (["--trainer", "rloo"] if how == "flag" else [])
    code, _, err = run_cli([command, *argv])
    assert code == 2 and f"trainer: rloo: {why}" in err and "takes trainer: grpo only" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.accelerator.is_available(), reason="what a machine without an accelerator does")
def test_rehearsal_of_the_rloo_preset_trains_rloo_through_both_passes_and_resumes(tmp_path):
    """The RLOO preset (not the paper's) as a user checks it: a dry run, then a rehearsal with LoptiRLOOTrainer."""
    preset = str(REPO / "configs/kk/qwen2.5-3b-instruct_rloo_ar_lopti.yaml")
    dry_run = run_command("train", "--config", preset, "--dry_run", cwd=tmp_path)
    assert dry_run.returncode == 0, dry_run.stderr[-3000:]
    resolved = json.loads(dry_run.stdout[dry_run.stdout.index("{\n") :])
    assert resolved["trainer"] == "rloo" and resolved["lopti"]["advantage_estimator"] == "rloo"
    result = run_command("train", "--config", preset, "--rehearse", "--output_dir", str(tmp_path / "kk"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "kk-rehearsal" / "rehearsal.json").read_text())
    assert report["trainer"] == "LoptiRLOOTrainer" and report["failures"] == [] and report["eta"] == [0.5]
    assert report["low_pass_steps"] == [1, 2] and report["high_pass_steps"] == [3, 4]  # one Lopti cycle
    assert 0.0 < report["low_token_share"][0] < 1.0
    assert min(report["low_pass_grad_norms"] + report["high_pass_grad_norms"]) > 0
    assert report["checkpoint"].endswith("(with lopti_generation_batch_rank0.pt)")
    assert report["resume_max_abs_difference"] <= 1e-6
