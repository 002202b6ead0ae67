"""`trl-lopti`: parsing (YAML + flags), clear errors, dataset building, and a real training run from a YAML file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trl_lopti.cli import CliError, build_datasets, parse_train_args, resolved_config


REPO = Path(__file__).resolve().parents[1]


def write_yaml(path: Path, values: dict) -> str:
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.fixture
def base(tmp_path, tiny_model_path):
    """The smallest valid config: a local model, CPU, an output folder."""
    return {"model_name_or_path": tiny_model_path, "output_dir": str(tmp_path / "out"), "use_cpu": True}


# ---------------------------------------------------------------------------------------------------------------------
# Commands and usage
# ---------------------------------------------------------------------------------------------------------------------
def test_usage_and_unknown_command(run_cli):
    code, out, _ = run_cli([])
    assert code == 2 and "train" in out and "demo" in out and "diagnose" in out
    code, _, err = run_cli(["trian"])
    assert code == 2 and "unknown command 'trian'" in err and "did you mean 'train'" in err
    code, out, _ = run_cli(["help"])
    assert code == 0 and "diagnose" in out
    code, out, _ = run_cli(["--version"])
    from trl_lopti import __version__

    assert code == 0 and out.strip() == f"trl-lopti {__version__}"


def test_python_dash_m_runs_the_cli(tmp_path, base):
    """`python -m trl_lopti` (what `accelerate launch -m trl_lopti` runs) reaches the same CLI."""
    config = write_yaml(tmp_path / "c.yaml", {**base, "task": "knights_knaves", "lopti_threshold": None})
    result = subprocess.run(
        [sys.executable, "-m", "trl_lopti", "train", "--config", config, "--dry_run", "--learning_rate", "3e-6"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout[result.stdout.index("{\n") :])  # after any banner a library prints on import
    assert resolved["training"]["learning_rate"] == 3e-6
    assert resolved["lopti"]["lopti_threshold"] is None
    assert resolved["model"] == {"model_name_or_path": base["model_name_or_path"], "source": "local"}


# ---------------------------------------------------------------------------------------------------------------------
# Parsing: YAML, overrides, None
# ---------------------------------------------------------------------------------------------------------------------
def test_yaml_values_flags_override_and_none(tmp_path, base):
    values = {
        **base,
        "learning_rate": "1e-6",  # YAML 1.1 reads 1e-6 as a string: converted to the field's type
        "lopti_threshold": None,
        "advantage_reweighting_alpha": 0.2,
        "kk_num_people": [3, 4],
        "use_peft": True,
        "lora_r": 4,
        "report_to": "none",
    }
    config = write_yaml(tmp_path / "c.yaml", values)
    script_args, training_args, model_args = parse_train_args(["--config", config])
    assert isinstance(training_args.learning_rate, float) and training_args.learning_rate == 1e-6
    assert training_args.lopti_threshold is None and training_args.advantage_reweighting_alpha == 0.2
    assert script_args.kk_num_people == [3, 4]
    assert model_args.use_peft is True and model_args.lora_r == 4

    # Flags override the file; "None" disables Lopti from the command line too.
    script_args, training_args, model_args = parse_train_args(
        ["--config", config, "--lopti_threshold", "0.4", "--lora_r", "8", "--kk_num_people", "5"]
    )
    assert training_args.lopti_threshold == 0.4 and model_args.lora_r == 8 and script_args.kk_num_people == [5]
    values["lopti_threshold"] = 0.5
    config = write_yaml(tmp_path / "c2.yaml", values)
    _, training_args, _ = parse_train_args(["--config", config, "--lopti_threshold", "None"])
    assert training_args.lopti_threshold is None


def test_dry_run_prints_the_resolved_config(tmp_path, base, run_cli):
    config = write_yaml(tmp_path / "c.yaml", {**base, "kk_num_people": [2, 3], "kk_num_samples": 7, "beta": 0.01})
    code, out, _ = run_cli(["train", "--config", config, "--dry_run", "--use_peft", "true", "--lora_r", "4"])
    assert code == 0
    resolved = json.loads(out)
    assert resolved["config_file"] == config
    assert resolved["dataset"] == {
        "task": "knights_knaves", "num_people": [2, 3], "prefill_think": True, "source": "generated",
        "num_samples": 7, "seed": 0,
    }  # fmt: skip
    assert resolved["reward_funcs"] == ["knights_knaves_reward"]
    assert resolved["model"]["peft"] == {"type": "LoraConfig", "r": 4, "lora_alpha": 32}
    assert resolved["training"]["beta"] == 0.01
    assert resolved["lopti"] == {
        "advantage_reweighting_alpha": 0.3, "lopti_threshold": 0.5, "lopti_quantile": None, "lopti_order": "low_first",
        "advantage_estimator": "grpo",
    }  # fmt: skip
    assert not (tmp_path / "out").exists()  # a dry run trains nothing


def test_dry_run_of_the_paper_data_sources(tmp_path, base, run_cli):
    """`kk_source: paper` and a paper math file are described without loading anything, with the test split."""
    config = write_yaml(tmp_path / "kk.yaml", {**base, "kk_source": "paper", "kk_data_dir": str(tmp_path),
                                               "kk_prefill_think": False, "eval_strategy": "steps"})  # fmt: skip
    code, out, err = run_cli(["train", "--config", config, "--dry_run"])
    assert code == 0, err
    assert json.loads(out)["dataset"] == {
        "task": "knights_knaves", "num_people": [3], "prefill_think": True, "source": "paper",
        "data_dir": str(tmp_path), "eval_split": "test",
    }  # fmt: skip
    config = write_yaml(tmp_path / "math.yaml", {**base, "task": "math", "dataset_name": "dsr_uniform",
                                                 "reward_funcs": ["math_reward_lenient"]})  # fmt: skip
    code, out, err = run_cli(["train", "--config", config, "--dry_run"])
    assert code == 0, err
    resolved = json.loads(out)
    assert resolved["dataset"] == {"task": "math", "source": "paper", "name": "dsr_uniform", "data_file": None}
    assert resolved["reward_funcs"] == ["math_reward_lenient"]
    code, _, err = run_cli(["train", "--config", config, "--dry_run", "--task", "knights_knaves", "--kk_source", "x"])
    assert code == 2 and "--kk_source" in err and "invalid choice: 'x'" in err


# ---------------------------------------------------------------------------------------------------------------------
# Errors name the file, field or path
# ---------------------------------------------------------------------------------------------------------------------
def test_missing_and_malformed_config_files(tmp_path, run_cli):
    missing = tmp_path / "nope.yaml"
    code, _, err = run_cli(["train", "--config", str(missing)])
    assert code == 2 and str(missing) in err and "does not exist" in err

    broken = tmp_path / "broken.yaml"
    broken.write_text("learning_rate: [1e-6\nbeta: 0.1\n")
    code, _, err = run_cli(["train", "--config", str(broken)])
    assert code == 2 and str(broken) in err and "not valid YAML" in err

    listing = tmp_path / "list.yaml"
    listing.write_text("- learning_rate\n- beta\n")
    code, _, err = run_cli(["train", "--config", str(listing)])
    assert code == 2 and "must contain a YAML mapping" in err

    code, _, err = run_cli(["train", "--config"])
    assert code == 2 and "expected a path" in err


def test_unknown_fields_and_bad_values(tmp_path, base, run_cli):
    config = write_yaml(tmp_path / "typo.yaml", {**base, "learnig_rate": 1e-6})
    code, _, err = run_cli(["train", "--config", config])
    assert code == 2 and "'learnig_rate'" in err and "did you mean 'learning_rate'" in err

    config = write_yaml(tmp_path / "bad.yaml", {**base, "learning_rate": "fast"})
    code, _, err = run_cli(["train", "--config", config])
    assert code == 2 and "learning_rate" in err and "'fast'" in err

    config = write_yaml(tmp_path / "alpha.yaml", {**base, "advantage_reweighting_alpha": 1.5})
    code, _, err = run_cli(["train", "--config", config])
    assert code == 2 and "advantage_reweighting_alpha" in err


def test_unknown_task(tmp_path, base, run_cli):
    config = write_yaml(tmp_path / "task.yaml", {**base, "task": "sudoku"})
    code, _, err = run_cli(["train", "--config", config])
    assert code == 2 and "task" in err and "'sudoku'" in err
    # argparse's own error for a bad choice on the command line, with the same exit code
    code, _, err = run_cli(["train", "--config", write_yaml(tmp_path / "ok.yaml", base), "--task", "sudoku"])
    assert code == 2 and "invalid choice: 'sudoku'" in err


def test_model_path_that_does_not_exist(tmp_path, base, run_cli):
    missing = str(tmp_path / "models" / "missing-model")
    config = write_yaml(tmp_path / "m.yaml", {**base, "model_name_or_path": missing})
    code, _, err = run_cli(["train", "--config", config, "--dry_run"])
    assert code == 2 and f"'{missing}' does not exist" in err and "model_name_or_path" in err

    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    code, _, err = run_cli(["train", "--config", config, "--dry_run", "--model_name_or_path", str(not_a_model)])
    assert code == 2 and "config.json" in err and str(not_a_model) in err

    config = write_yaml(tmp_path / "none.yaml", {k: v for k, v in base.items() if k != "model_name_or_path"})
    code, _, err = run_cli(["train", "--config", config, "--dry_run"])
    assert code == 2 and "model_name_or_path: required" in err


def test_dataset_task_errors(tmp_path, base, run_cli):
    config = write_yaml(tmp_path / "d.yaml", {**base, "task": "dataset", "reward_funcs": ["accuracy_reward"]})
    code, _, err = run_cli(["train", "--config", config, "--dry_run"])
    assert code == 2 and "dataset_name: required" in err

    missing = str(tmp_path / "data" / "train.jsonl")
    code, _, err = run_cli(["train", "--config", config, "--dry_run", "--dataset_name", missing])
    assert code == 2 and f"'{missing}' does not exist" in err

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "solution": "1"}) + "\n")
    code, _, err = run_cli(
        ["train", "--config", config, "--dry_run", "--dataset_name", str(data), "--reward_funcs", "no_such_reward"]
    )
    assert code == 2 and "unknown reward function 'no_such_reward'" in err
    code, _, err = run_cli(
        ["train", "--config", config, "--dry_run", "--dataset_name", str(data), "--reward_funcs", "nowhere.reward"]
    )
    assert code == 2 and "cannot import module 'nowhere'" in err
    config = write_yaml(tmp_path / "d2.yaml", {**base, "task": "dataset", "dataset_name": str(data)})
    code, _, err = run_cli(["train", "--config", config, "--dry_run"])
    assert code == 2 and "reward_funcs: required" in err


# ---------------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------------
def test_build_generated_knights_knaves_with_eval_split(tmp_path, base):
    config = write_yaml(tmp_path / "kk.yaml", {**base, "kk_num_people": [2, 3], "kk_num_samples": 6,
                                               "kk_num_eval_samples": 3, "eval_strategy": "steps", "eval_steps": 1})  # fmt: skip
    script_args, training_args, _ = parse_train_args(["--config", config])
    train, evaluation = build_datasets(script_args, training_args)
    assert len(train) == 6 and len(evaluation) == 3
    assert sorted(set(train["num_people"])) == [2, 3]
    assert not set(train["quiz"]) & set(evaluation["quiz"])  # held-out puzzles are new puzzles
    assert {"prompt", "solution_text_format"} <= set(train.column_names)


def test_build_local_datasets(tmp_path, base):
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    math_file = tmp_path / "math.jsonl"
    math_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = write_yaml(tmp_path / "m.yaml", {**base, "task": "math", "dataset_name": str(math_file), "max_train_samples": 3})
    script_args, training_args, model_args = parse_train_args(["--config", config])
    train, evaluation = build_datasets(script_args, training_args)
    assert len(train) == 3 and evaluation is None
    assert {"prompt", "solution"} <= set(train.column_names)
    assert {int(s) for s in train["solution"]} <= {i + 1 for i in range(5)}
    assert resolved_config(script_args, training_args, model_args)["reward_funcs"] == ["math_reward"]

    from datasets import Dataset, DatasetDict

    folder = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]), "test": Dataset.from_list([{"prompt": "c"}])}).save_to_disk(folder)
    config = write_yaml(tmp_path / "d.yaml", {**base, "task": "dataset", "dataset_name": str(folder),
                                              "reward_funcs": ["trl_lopti.tasks.arithmetic.exact_answer_reward"], "eval_strategy": "steps"})  # fmt: skip
    script_args, training_args, _ = parse_train_args(["--config", config])
    train, evaluation = build_datasets(script_args, training_args)
    assert train["prompt"] == ["a", "b"] and evaluation["prompt"] == ["c"]

    no_prompt = tmp_path / "noprompt.jsonl"
    no_prompt.write_text(json.dumps({"question": "x"}) + "\n")
    script_args, training_args, _ = parse_train_args(["--config", config, "--dataset_name", str(no_prompt), "--eval_strategy", "no"])
    with pytest.raises(CliError, match="no 'prompt' column"):
        build_datasets(script_args, training_args)


# ---------------------------------------------------------------------------------------------------------------------
# A real run
# ---------------------------------------------------------------------------------------------------------------------
def test_train_from_yaml_with_lora(tmp_path, base, run_cli):
    """`trl-lopti train --config` trains a tiny model with LoRA, AR and Lopti on a local dataset, and saves it."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 2? The answer is", "answer": i + 2}) + "\n" for i in range(4)))
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
    config = write_yaml(tmp_path / "train.yaml", values)
    code, out, err = run_cli(["train", "--config", config])
    assert code == 0, err
    out_dir = Path(base["output_dir"])
    adapter = json.loads((out_dir / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    assert (out_dir / "adapter_model.safetensors").is_file()
    assert "model saved to" in out + err


def test_train_knights_knaves_renders_the_prefilled_think(tmp_path, base, run_cli, monkeypatch):
    """With `kk_prefill_think`, the CLI hands GRPOTrainer text prompts left open at "<think>"."""
    import trl_lopti.tasks.knights_knaves as knights_knaves

    rendered = []
    original = knights_knaves.render_prompts_as_text

    def recording_render(dataset, tokenizer, prompt_column="prompt"):
        result = original(dataset, tokenizer, prompt_column)
        rendered.extend(result[prompt_column])
        return result

    monkeypatch.setattr(knights_knaves, "render_prompts_as_text", recording_render)
    values = {
        **base, "task": "knights_knaves", "kk_num_people": [2], "kk_num_samples": 2, "kk_prefill_think": True,
        "max_steps": 1, "per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 4,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none",
    }
    code, out, err = run_cli(["train", "--config", write_yaml(tmp_path / "kk.yaml", values)])
    assert code == 0, err
    assert len(rendered) == 2 and all(text.endswith("<|im_start|>assistant\n<think>") for text in rendered)
