"""Every preset under configs/ parses through the `trl-lopti train` parser (dry run) and keeps the paper's settings."""

import re
from pathlib import Path

import pytest
import yaml

from trl_lopti.cli import parse_train_args, resolved_config


CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TRAINING_PRESETS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name != "accelerate")
ACCELERATE_CONFIGS = sorted((CONFIGS / "accelerate").glob("*.yaml"))

# Method suffix of a preset file name -> (advantage_reweighting_alpha, lopti_threshold); AR alone is 0.2 on K&K and
# 0.1 on math in the paper.
METHODS = {"grpo": (0.0, None), "lopti": (0.0, 0.5), "ar_lopti": (0.3, 0.5)}
AR_ALPHA = {"kk": 0.2, "math": 0.1}
# Which accelerate config a preset is launched with (its header says so), to check the global batch.
LAUNCH_CONFIG = {"kk": "multi_gpu.yaml", "math": "multi_gpu.yaml", "vllm": "vllm_server.yaml"}


def method_of(path: Path) -> str:
    stem = path.stem.removesuffix("_server")
    for suffix in ("ar_lopti", "lopti", "grpo", "ar"):
        if stem.endswith("_" + suffix):
            return suffix
    raise AssertionError(f"{path.name}: name must end with _grpo, _ar, _lopti or _ar_lopti")


def test_the_presets_of_the_issue_exist():
    names = {str(p.relative_to(CONFIGS)) for p in TRAINING_PRESETS}
    for model in ("qwen2.5-3b-instruct", "qwen2.5-7b-instruct-1m"):
        for method in ("grpo", "ar", "lopti", "ar_lopti"):
            assert f"kk/{model}_{method}.yaml" in names
    assert {"math/qwen2.5-7b_deepscaler_ar.yaml", "math/qwen2.5-7b_deepscaler_lopti.yaml"} <= names
    assert any(p.parent.name == "vllm" for p in TRAINING_PRESETS)
    assert {p.name for p in ACCELERATE_CONFIGS} >= {"multi_gpu.yaml", "zero2.yaml", "zero3.yaml", "fsdp2.yaml", "vllm_server.yaml"}


@pytest.mark.parametrize("path", TRAINING_PRESETS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_preset_parses_with_the_paper_hyperparameters(path, capsys):
    script_args, training_args, model_args = parse_train_args(["--config", str(path), "--dry_run"])
    resolved = resolved_config(script_args, training_args, model_args)  # validates model, dataset spec and rewards
    group = path.parent.name

    # Every key of the file reached a dataclass with the file's value, converted to the field's type.
    raw = yaml.safe_load(path.read_text())
    for key, value in raw.items():
        parsed = next(getattr(obj, key) for obj in (script_args, training_args, model_args) if hasattr(obj, key))
        if key == "report_to":
            assert parsed == [value]
        elif isinstance(value, float) or key == "learning_rate":
            assert isinstance(parsed, float) and parsed == pytest.approx(float(value)), key
        else:
            assert parsed == value, key

    # The paper's K&K script: lr 1e-6, 8 rollouts, T=0.7, clip 0.20/0.24, KL 0.001 (k3), 4096 tokens, 5 epochs.
    assert training_args.learning_rate == 1e-6
    assert training_args.num_generations == 8
    assert training_args.temperature == 0.7
    assert (training_args.epsilon, training_args.epsilon_high) == (0.2, 0.24)
    assert training_args.beta == 0.001 and training_args.use_bias_correction_kl is False
    assert training_args.max_completion_length == 4096
    assert training_args.num_train_epochs == 5
    assert training_args.report_to == ["wandb"]

    # Global batch: 64 prompts x 8 rollouts, one optimizer update per generation batch, on the paired launcher.
    launcher = yaml.safe_load((CONFIGS / "accelerate" / LAUNCH_CONFIG[group]).read_text())
    completions = training_args.per_device_train_batch_size * launcher["num_processes"] * training_args.gradient_accumulation_steps
    assert completions == 64 * 8
    assert training_args.steps_per_generation == training_args.gradient_accumulation_steps
    assert f"--config_file configs/accelerate/{LAUNCH_CONFIG[group]}" in path.read_text()
    assert f"--config {path.relative_to(CONFIGS.parent)}" in path.read_text()

    # AR and Lopti settings by file name.
    method = method_of(path)
    alpha, eta = (AR_ALPHA["math" if group == "math" else "kk"], None) if method == "ar" else METHODS[method]
    assert training_args.advantage_reweighting_alpha == alpha
    assert training_args.lopti_threshold == eta
    assert training_args.lopti_order == "low_first"
    assert resolved["lopti"] == {"advantage_reweighting_alpha": alpha, "lopti_threshold": eta, "lopti_order": "low_first"}

    # Task and model.
    if group == "math":
        assert script_args.task == "math" and model_args.model_name_or_path == "Qwen/Qwen2.5-7B"
        assert resolved["dataset"]["hub_id"] == "agentica-org/DeepScaleR-Preview-Dataset"
        assert resolved["reward_funcs"] == ["math_reward"]
    else:
        assert script_args.task == "knights_knaves" and script_args.kk_num_people == [3, 4, 5, 6, 7]
        assert resolved["dataset"] == {
            "task": "knights_knaves", "num_people": [3, 4, 5, 6, 7], "prefill_think": True, "source": "hub",
            "path": "K-and-K/knights-and-knaves", "subset": "train",
        }  # fmt: skip
        assert resolved["reward_funcs"] == ["knights_knaves_reward"]
        model_slug = path.stem.split("_")[0]
        assert model_args.model_name_or_path.lower() == "qwen/" + model_slug
    assert resolved["model"]["source"] == "hub"
    assert model_args.dtype == "bfloat16"


def test_vllm_preset_matches_its_serve_command():
    (preset,) = [p for p in TRAINING_PRESETS if p.parent.name == "vllm"]
    _, training_args, model_args = parse_train_args(["--config", str(preset), "--dry_run"])
    assert training_args.use_vllm and training_args.vllm_mode == "server"
    for text in (preset.read_text(), (CONFIGS / "accelerate" / "vllm_server.yaml").read_text()):
        command = re.search(r"vllm serve (\S+)", text)
        assert command is not None and command.group(1) == model_args.model_name_or_path
        assert f"--port {training_args.vllm_server_port}" in text
        assert "VLLM_SERVER_DEV_MODE=1" in text and '"backend": "nccl"' in text


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads_with_accelerate(path):
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(path))
    expected = {
        "multi_gpu.yaml": "MULTI_GPU", "vllm_server.yaml": "MULTI_GPU", "zero2.yaml": "DEEPSPEED",
        "zero3.yaml": "DEEPSPEED", "fsdp2.yaml": "FSDP",
    }  # fmt: skip
    assert str(config.distributed_type).split(".")[-1] == expected[path.name]
    assert config.mixed_precision == "bf16" and config.use_cpu is False
    if path.name.startswith("zero"):
        assert config.deepspeed_config["zero_stage"] == int(path.stem[-1])
    if path.name == "fsdp2.yaml":
        assert config.fsdp_config["fsdp_version"] == 2
    if path.name == "vllm_server.yaml":
        gpu_ids = str(config.gpu_ids).split(",")
        assert len(gpu_ids) == config.num_processes and "0" not in gpu_ids  # GPU 0 is left to `vllm serve`
    assert re.search(r"-m trl_lopti train[\s\\#]*--config configs/", path.read_text())  # a shell line may wrap
