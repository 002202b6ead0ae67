"""Every preset under configs/ parses through the parser of the command that trains it (dry run) and reproduces the
authors' scripts (`scripts/train_kklogic_*_4x80GB.sh` of zhyang2226/AR-Lopti, a verl fork) in TRL's terms; the presets
are installed with the package, named as `--config` takes them, and listed by `trl-lopti presets`."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml
from trl import GRPOConfig

from trl_lopti.cli.train import checked_args, parse_train_args


CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TRAINING_PRESETS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name != "accelerate")
ACCELERATE_CONFIGS = sorted((CONFIGS / "accelerate").glob("*.yaml"))
NUM_PROCESSES = 4  # trainer.n_gpus_per_node=4 in the authors' scripts; every preset says it assumes 4

# The authors' K&K script (identical in the four files but for alpha / eta / SEPERATE_UPDT), in verl's names.
SCRIPT = {
    "TRAIN_BS": 64,
    "ROLLOUT_N": 8,
    "UPDATE_BS": 256,
    "MICRO_BS": 32,
    "LR": 1e-6,
    "EPOCH": 5,
    "ROLLOUT_TEMP": 0.7,
    "CLIP_LOW": 0.2,
    "CLIP_HIGH": 0.24,
    "clip_ratio_c": 10.0,
    "KL_COEF": 0.001,
    "max_response_length": 4096,
    "weight_decay": 0.01,
    "grad_clip": 1.0,
    "test_freq": 20,
    "save_freq": 20,
}
# (advantage_estimator, alpha, eta) by the method suffix of a file name: the scripts' REWEIGHT_K / SEPERATE_PROB on
# K&K; the paper's text for math (alpha 0.1, eta 0.5) and for REINFORCE++ (alpha 0.1, eta 0.5).
KK_METHODS = {
    "grpo": ("grpo", 0.0, None),
    "ar": ("grpo", 0.2, None),
    "lopti": ("grpo", 0.0, 0.4),
    "ar_lopti": ("grpo", 0.3, 0.5),
    "reinforce_pp": ("reinforce_plus_plus", 0.0, None),
    "reinforce_pp_ar": ("reinforce_plus_plus", 0.1, None),
    "reinforce_pp_lopti": ("reinforce_plus_plus", 0.0, 0.5),
    "reinforce_pp_ar_lopti": ("reinforce_plus_plus", 0.1, 0.5),
    "rloo_ar_lopti": ("rloo", 0.3, 0.5),  # NOT the paper's: the AR + Lopti preset on RLOO (see the test at the end)
}
MATH_METHODS = {"grpo": ("grpo", 0.0, None), "ar": ("grpo", 0.1, None), "lopti": ("grpo", 0.0, 0.5)}
SCRIPT_OF = {"grpo": "baseline", "ar": "AR", "lopti": "Lopti", "ar_lopti": "AR-Lopti"}


def command_of(path: Path) -> str:
    """The command that trains a preset: the one its `trainer:` key names (a check), else `grpo`."""
    return yaml.safe_load(path.read_text()).get("trainer", "grpo")


def name_of(path: Path) -> str:
    """A preset's name, as `--config` takes it: `kk/qwen2.5-3b-instruct_ar_lopti`."""
    return path.relative_to(CONFIGS).with_suffix("").as_posix()


def method_of(path: Path, methods: dict) -> str:
    stem = path.stem.removesuffix("_server")
    matches = [method for method in methods if stem.endswith("_" + method)]
    assert matches, f"{path.name}: name must end with one of {sorted(methods)}"
    return max(matches, key=len)


def test_the_presets_of_the_issue_exist():
    names = {str(p.relative_to(CONFIGS)) for p in TRAINING_PRESETS}
    for model in ("qwen2.5-3b-instruct", "qwen2.5-7b-instruct-1m"):
        for method in ("grpo", "ar", "lopti", "ar_lopti"):
            assert f"kk/{model}_{method}.yaml" in names
    for method in ("reinforce_pp", "reinforce_pp_ar", "reinforce_pp_lopti", "reinforce_pp_ar_lopti"):
        assert f"kk/qwen2.5-3b-instruct_{method}.yaml" in names
    assert {f"math/qwen2.5-7b_dsr_uniform_{method}.yaml" for method in MATH_METHODS} <= names
    assert any(p.parent.name == "vllm" for p in TRAINING_PRESETS)
    launchers = {"multi_gpu.yaml", "zero2.yaml", "zero3.yaml", "fsdp2.yaml", "fsdp2_offload.yaml", "vllm_server.yaml"}
    assert {p.name for p in ACCELERATE_CONFIGS} >= launchers


@pytest.mark.parametrize("path", TRAINING_PRESETS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_preset_reproduces_the_authors_script(path, capsys):
    script_args, training_args, model_args, resolved = checked_args(
        ["--config", str(path), "--dry_run"], command_of(path)
    )
    group = path.parent.name
    text = path.read_text()

    # Every key of the file reached a dataclass with the file's value, converted to the field's type.
    raw = yaml.safe_load(text)
    for key, value in ((key, value) for key, value in raw.items() if key != "trainer"):  # (the command's check)
        parsed = next(getattr(obj, key) for obj in (script_args, training_args, model_args) if hasattr(obj, key))
        if key == "report_to":
            assert parsed == [value]
        elif isinstance(value, float) or key == "learning_rate":
            assert isinstance(parsed, float) and parsed == pytest.approx(float(value)), key
        else:
            assert parsed == value, key

    # Optimiser, sampling and loss: the script's values.
    assert training_args.learning_rate == SCRIPT["LR"]
    assert training_args.lr_scheduler_type == "constant" and training_args.warmup_steps == 0
    assert training_args.weight_decay == SCRIPT["weight_decay"] and training_args.max_grad_norm == SCRIPT["grad_clip"]
    assert training_args.num_generations == SCRIPT["ROLLOUT_N"] and training_args.temperature == SCRIPT["ROLLOUT_TEMP"]
    assert (training_args.epsilon, training_args.epsilon_high) == (SCRIPT["CLIP_LOW"], SCRIPT["CLIP_HIGH"])
    if command_of(path) == "grpo":  # GRPO's loss and KL: RLOO has neither (its preset: the test at the end)
        assert training_args.delta == SCRIPT["clip_ratio_c"]
        assert training_args.beta == SCRIPT["KL_COEF"] and training_args.use_bias_correction_kl is False
        assert training_args.loss_type == "bnpo"  # verl's token-mean over each micro-batch (see the preset header)
    assert training_args.max_completion_length == SCRIPT["max_response_length"]
    assert training_args.num_train_epochs == SCRIPT["EPOCH"] and training_args.num_iterations == 1
    assert training_args.report_to == ["wandb"]

    # Schedule on the 4 processes the preset assumes: micro-batch 32, optimizer step 256, generation batch 512.
    assert f"{NUM_PROCESSES} processes" in text
    per_micro_step = training_args.per_device_train_batch_size * NUM_PROCESSES
    assert per_micro_step == SCRIPT["MICRO_BS"]
    assert per_micro_step * training_args.gradient_accumulation_steps == SCRIPT["UPDATE_BS"]
    assert per_micro_step * training_args.steps_per_generation == SCRIPT["TRAIN_BS"] * SCRIPT["ROLLOUT_N"]
    optimizer_steps_per_pass = training_args.steps_per_generation // training_args.gradient_accumulation_steps
    assert optimizer_steps_per_pass == SCRIPT["TRAIN_BS"] * SCRIPT["ROLLOUT_N"] // SCRIPT["UPDATE_BS"] == 2
    passes = training_args.lopti_num_passes
    assert training_args.save_steps == SCRIPT["save_freq"] * optimizer_steps_per_pass * passes
    if group == "vllm":  # its launcher runs 4 training processes (GPU 0 serves vLLM)
        launcher = yaml.safe_load((CONFIGS / "accelerate" / "vllm_server.yaml").read_text())
        assert launcher["num_processes"] == NUM_PROCESSES
    else:
        assert f"--num_processes {NUM_PROCESSES}" in text
    assert f"-m trl_lopti {command_of(path)} --config {name_of(path)}" in text

    # Method: estimator, alpha and eta by file name; the header names the script it reproduces.
    methods = MATH_METHODS if group == "math" else KK_METHODS
    method = method_of(path, methods)
    estimator, alpha, eta = methods[method]
    assert getattr(training_args, "advantage_estimator", "rloo") == estimator  # LoptiRLOOConfig has RLOO's only
    assert training_args.advantage_reweighting_alpha == alpha
    assert training_args.lopti_threshold == eta
    assert training_args.lopti_order == "low_first"
    expected_lopti = {
        "advantage_reweighting_alpha": alpha,
        "lopti_threshold": eta,
        "lopti_quantile": None,
        "lopti_order": "low_first",
        **({} if estimator == "rloo" else {"advantage_estimator": estimator}),
    }
    assert resolved["lopti"] == expected_lopti
    if method in SCRIPT_OF:
        assert f"scripts/train_kklogic_{SCRIPT_OF[method]}_4x80GB.sh" in text or group == "math"
    header = text.split("\n\n", 1)[0]
    assert "Remaining differences" in text and "delta" in header and "max_prompt_length" in header

    # Data: the paper's split, prompt text and grader.
    if group == "math":
        assert script_args.task == "math" and model_args.model_name_or_path == "Qwen/Qwen2.5-7B"
        assert script_args.dataset_name == "dsr_uniform" and script_args.math_data_file is None
        assert resolved["reward_funcs"] == ["math_reward"]
    else:
        assert script_args.task == "knights_knaves" and script_args.kk_source == "paper"
        assert script_args.kk_num_people == [3, 4, 5, 6, 7] and script_args.kk_data_dir is None
        assert training_args.eval_strategy == "steps" and script_args.dataset_test_split == "test"
        assert training_args.eval_steps == SCRIPT["test_freq"] * optimizer_steps_per_pass * passes
        assert resolved["reward_funcs"] == ["knights_knaves_reward"]
        model_slug = path.stem.split("_")[0]
        assert model_args.model_name_or_path.lower() == "qwen/" + model_slug

    # Precision and launcher: fp32 master weights with bf16 compute (tests/test_precision.py runs the step), loaded
    # on the CPU for the launcher to shard; the header's launcher is sharded FSDP2 with bf16 mixed precision, with CPU
    # offload for the 7B models, and the header gives the memory arithmetic.
    assert model_args.dtype == "float32" and training_args.bf16 is True
    assert training_args.model_init_kwargs == {"device_map": None}
    launch = r'accelerate launch --config_file "\$\(trl-lopti presets --path accelerate/([\w.]+)\)"'
    launcher_name = re.search(launch, text).group(1)
    launcher = yaml.safe_load((CONFIGS / "accelerate" / f"{launcher_name}.yaml").read_text())
    assert launcher["mixed_precision"] == "bf16" and launcher["distributed_type"] == "FSDP"
    assert launcher["fsdp_config"]["fsdp_version"] == 2
    is_7b = "7B" in model_args.model_name_or_path
    assert launcher["fsdp_config"]["fsdp_offload_params"] is is_7b
    memory_line = next(line for line in text.splitlines() if line.startswith("# Memory per GPU"))
    for part in ("fp32 weights + gradients + AdamW 16 B", "reference model", "activations", "4,096", "of 80"):
        assert part in memory_line
    assert ("7.62B" if is_7b else "3.09B") in memory_line
    assert "empty pass" not in text  # the trainer steps the optimizer on an empty Lopti pass, as the authors
    if group == "vllm":
        assert training_args.vllm_importance_sampling_correction is False


def verl_dual_clip_loss(ratio, advantages, clip_low, clip_high, clip_ratio_c):
    """verl's per-token policy loss with dual clip (its core_algos.compute_policy_loss), written from its definition."""
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    dual = torch.minimum(-advantages * clip_ratio_c, clipped)
    return torch.where(advantages < 0, dual, clipped)


def trl_delta_loss(ratio, advantages, epsilon, epsilon_high, delta):
    """TRL 1.16's per-token loss for loss_type grpo/bnpo/dapo with two-sided clipping `delta`."""
    clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    return -torch.minimum(ratio.clamp(max=delta) * advantages, clipped_ratio * advantages)


def test_trl_delta_is_verl_dual_clip_at_the_preset_values():
    # The presets use `delta` for verl's clip_ratio_c: same per-token loss and gradient for every ratio and sign
    # of the advantage, as long as delta > 1 + epsilon_high (ratios avoid the kinks, where gradients are ambiguous).
    preset = CONFIGS / "kk" / "qwen2.5-3b-instruct_ar_lopti.yaml"
    _, training_args, _ = parse_train_args(["--config", str(preset), "--dry_run"])
    epsilon, epsilon_high, delta = training_args.epsilon, training_args.epsilon_high, training_args.delta
    kinks = torch.tensor([1 - epsilon, 1 + epsilon_high, delta], dtype=torch.float64)
    ratios = torch.cat([torch.linspace(0.05, 30.0, 4001, dtype=torch.float64), torch.tensor([9.5, 10.5, 25.0])])
    ratios = ratios[(ratios[:, None] - kinks).abs().min(dim=1).values > 1e-6]
    for advantage in (-2.0, -0.3, 0.7, 1.5):
        ratio_a = ratios.clone().requires_grad_(True)
        ratio_b = ratios.clone().requires_grad_(True)
        advantages = torch.full_like(ratios, advantage)
        verl = verl_dual_clip_loss(ratio_a, advantages, epsilon, epsilon_high, delta)
        trl = trl_delta_loss(ratio_b, advantages, epsilon, epsilon_high, delta)
        torch.testing.assert_close(trl, verl, rtol=0, atol=1e-12)
        verl.sum().backward()
        trl.sum().backward()
        torch.testing.assert_close(ratio_b.grad, ratio_a.grad, rtol=0, atol=1e-12)
    # The dual clip binds: above c a negative-advantage token's loss is constant (|A| * c) and has no gradient.
    capped = verl_dual_clip_loss(torch.tensor([25.0]), torch.tensor([-2.0]), epsilon, epsilon_high, delta)
    assert capped.item() == 2.0 * delta
    # And the equivalence needs delta > 1 + epsilon_high: with delta = 1.1, positive advantages differ.
    low = trl_delta_loss(torch.tensor([1.2]), torch.tensor([1.0]), epsilon, epsilon_high, 1.1)
    dual = verl_dual_clip_loss(torch.tensor([1.2]), torch.tensor([1.0]), epsilon, epsilon_high, 1.1)
    assert low.item() != dual.item()


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
        "multi_gpu.yaml": "MULTI_GPU",
        "vllm_server.yaml": "FSDP",
        "zero2.yaml": "DEEPSPEED",
        "zero3.yaml": "DEEPSPEED",
        "fsdp2.yaml": "FSDP",
        "fsdp2_offload.yaml": "FSDP",
    }
    assert str(config.distributed_type).split(".")[-1] == expected[path.name]
    assert config.mixed_precision == "bf16" and config.use_cpu is False
    if path.name.startswith("zero"):
        assert config.deepspeed_config["zero_stage"] == int(path.stem[-1])
    if str(config.distributed_type).endswith("FSDP"):
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_offload_params"] is (path.name == "fsdp2_offload.yaml")
        # TRL shards the reference model without accelerate's rank-0 broadcast: every rank must load real weights
        assert config.fsdp_config["fsdp_cpu_ram_efficient_loading"] is False
    if path.name == "vllm_server.yaml":
        gpu_ids = str(config.gpu_ids).split(",")
        assert len(gpu_ids) == config.num_processes and "0" not in gpu_ids  # GPU 0 is left to `vllm serve`
    assert re.search(r"-m trl_lopti grpo[\s\\#]*--config (kk|vllm)/", path.read_text())  # a shell line may wrap


def write_paper_data(folder: Path) -> dict:
    """Local copies of the authors' files, in their layout and columns: K&K (3 people) and DSR-uniform."""
    import datasets

    from trl_lopti.tasks import knights_knaves as kk

    def kk_row(puzzle, index):
        return {**puzzle, "index": index, "prompt": [{"content": kk.paper_prompt(puzzle["quiz"]), "role": "user"}]}

    indices = [100, 101, 102, 103, 1000, 1001]  # the paper's train and test ranges
    rows = [
        kk_row(puzzle, index)
        for puzzle, index in zip(kk.generate_puzzles(3, len(indices), seed=0), indices, strict=True)
    ]
    (folder / "3ppl").mkdir(parents=True)
    datasets.Dataset.from_list(rows[:4]).to_parquet(str(folder / "3ppl" / "train.parquet"))
    datasets.Dataset.from_list(rows[4:]).to_parquet(str(folder / "3ppl" / "test.parquet"))
    suffix = "Let's think step by step and output the final answer within \\boxed{}."
    math_rows = [
        {
            "prompt": [{"content": f"What is {i} + {i}? {suffix}", "role": "user"}],
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
        }
        for i in range(4)
    ]
    datasets.Dataset.from_list(math_rows).to_parquet(str(folder / "dsr.parquet"))
    return {
        "kk": ["--kk_num_people", "3", "--kk_data_dir", str(folder)],
        "math": ["--math_data_file", str(folder / "dsr.parquet")],
    }


PRESETS_TRAINED = [
    "kk/qwen2.5-3b-instruct_ar_lopti.yaml",
    "kk/qwen2.5-3b-instruct_reinforce_pp_ar_lopti.yaml",
    "math/qwen2.5-7b_dsr_uniform_lopti.yaml",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS_TRAINED)
def test_preset_trains_a_tiny_model_through_the_cli(name, tmp_path, tiny_model_path):
    """The preset's own loss, KL, estimator, precision and data settings in a real run: only sizes, the model and the
    data files (local copies of the authors') are overridden."""
    from trl_lopti.cli.train import run_training

    local_data = write_paper_data(tmp_path / "data")[name.split("/")[0]]
    argv = [
        "--config",
        str(CONFIGS / name),
        "--model_name_or_path",
        tiny_model_path,
        "--output_dir",
        str(tmp_path / "out"),
        "--use_cpu",
        "true",
        "--report_to",
        "none",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "1",
        "--steps_per_generation",
        "1",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        *local_data,
    ]
    trainer = run_training(*parse_train_args(argv))
    assert trainer.state.global_step == 2 and trainer.args.beta == SCRIPT["KL_COEF"] and trainer.ref_model is not None
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"lopti/loss_low_pass", "lopti/loss_high_pass", "kl"} <= logged  # both Lopti passes ran, with the KL term
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_the_rloo_preset_is_the_ar_lopti_preset_on_rloo_with_rloos_defaults():
    """The one preset not from the paper (which has no RLOO run): every key RLOOConfig shares with GRPOConfig has the
    value of the GRPO AR + Lopti preset, RLOO's own keys and `beta` have RLOOConfig's defaults, and the header says
    so, naming every key of the GRPO preset that it drops."""
    from trl import RLOOConfig

    from trl_lopti import LoptiRLOOConfig

    paths = [CONFIGS / "kk" / f"qwen2.5-3b-instruct_{method}.yaml" for method in ("rloo_ar_lopti", "ar_lopti")]
    rloo, grpo = (parse_train_args(["--config", str(path), "--dry_run"], command_of(path)) for path in paths)
    assert isinstance(rloo[1], LoptiRLOOConfig) and [command_of(path) for path in paths] == ["rloo", "grpo"]
    differences = set()
    for rloo_args, grpo_args in zip(rloo, grpo, strict=True):  # script, training and model arguments
        shared = {f.name for f in dataclasses.fields(rloo_args)} & {f.name for f in dataclasses.fields(grpo_args)}
        differences |= {key for key in shared if getattr(rloo_args, key) != getattr(grpo_args, key)}
    assert differences == {"beta", "output_dir", "run_name"}
    defaults = {f.name: f.default for f in dataclasses.fields(RLOOConfig)}
    assert rloo[1].beta == defaults["beta"] == 0.05 and not hasattr(rloo[1], "advantage_estimator")
    rloo_only = {f.name for f in dataclasses.fields(RLOOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    assert rloo_only == {"normalize_advantages", "reward_clip_range"}
    assert all(getattr(rloo[1], key) == defaults[key] for key in rloo_only)
    # the header: not from the paper; RLOO's default KL, not the paper's; every dropped key of the GRPO preset named
    text, (rloo_keys, grpo_keys) = paths[0].read_text(), (set(yaml.safe_load(path.read_text())) for path in paths)
    header = text.split("\n\n", 1)[0]
    assert "NOT from the paper" in header.splitlines()[0] and "no RLOO run" in header
    assert "beta 0.05 is RLOOConfig's DEFAULT" in header and "NOT the paper's KL" in header and "0.001" in header
    assert rloo_keys - grpo_keys == {"trainer", "normalize_advantages"}
    dropped = grpo_keys - rloo_keys
    assert dropped == {"delta", "use_bias_correction_kl", "loss_type", "advantage_estimator", "scale_rewards"}
    assert all(re.search(rf"\b{key}\b", header) for key in dropped), [k for k in dropped if k not in header]


# ---------------------------------------------------------------------------------------------------------------------
# The presets installed with the package: by name, listed, checked (`make presets`)
# ---------------------------------------------------------------------------------------------------------------------
def test_the_presets_are_package_data_listed_one_line_each(run_cli):
    """`trl_lopti/presets` is configs/ (a link in the checkout, package data in the wheel: .ci/run's wheel stage), and
    `trl-lopti presets` lists each training preset: its name, its command, its header's first line and script."""
    from trl_lopti.cli.presets import PRESETS

    assert PRESETS.resolve() == CONFIGS.resolve() and (Path(PRESETS.parent) / "cli").is_dir()
    code, out, _ = run_cli(["presets"])
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"presets in {PRESETS} (trl-lopti COMMAND --config NAME):"
    assert lines[-1] == f"launchers (accelerate launch --config_file FILE): {PRESETS / 'accelerate'}/*.yaml"
    rows = [line.split(maxsplit=2) for line in lines[1:-1]]
    assert [row[:2] for row in rows] == [[name_of(path), command_of(path)] for path in TRAINING_PRESETS]
    for (_, _, what), path in zip(rows, TRAINING_PRESETS, strict=True):
        header = path.read_text().splitlines()
        script = re.match(r"# Reproduces scripts/(\S+)", header[1])
        assert what == header[0].removeprefix("# ") + (f" (the authors' {script[1]})" if script else "")
    assert [
        "kk/qwen2.5-3b-instruct_rloo_ar_lopti",
        "rloo",
        "Knights & Knaves, Qwen/Qwen2.5-3B-Instruct, RLOO + AR + Lopti -- NOT from the paper",
    ] in rows


def test_a_preset_by_name_is_its_file_and_a_near_miss_gets_the_nearest_name(run_cli):
    path = CONFIGS / "kk" / "qwen2.5-3b-instruct_ar_lopti.yaml"
    by_path = parse_train_args(["--config", str(path), "--dry_run"])
    for name in ("kk/qwen2.5-3b-instruct_ar_lopti", "kk/qwen2.5-3b-instruct_ar_lopti.yaml"):
        assert parse_train_args(["--config", name, "--dry_run"]) == by_path
    code, _, err = run_cli(["grpo", "--config", "kk/qwen2.5-3b-instruct_ar_lopt", "--dry_run"])
    assert code == 2 and "no file kk/qwen2.5-3b-instruct_ar_lopt, nor a preset of that name; did you mean " in err
    assert err.rstrip().endswith("kk/qwen2.5-3b-instruct_ar_lopti?")


def test_presets_dry_run_checks_every_preset_and_fails_on_a_bad_one(tmp_path, monkeypatch, run_cli):
    """`make presets`: every preset parsed and checked with the command its `trainer:` names; a bad value stops it."""
    from trl_lopti.cli import presets

    code, out, err = run_cli(["presets", "--dry_run"])
    assert code == 0 and len(out.splitlines()) == len(TRAINING_PRESETS) + 2, err
    (tmp_path / "kk").mkdir()
    bad = yaml.safe_load((CONFIGS / "kk" / "qwen2.5-3b-instruct_lopti.yaml").read_text()) | {"lopti_threshold": 1.4}
    (tmp_path / "kk" / "bad.yaml").write_text("# a bad preset\n" + yaml.safe_dump(bad))
    monkeypatch.setattr(presets, "PRESETS", tmp_path)
    code, out, err = run_cli(["presets", "--dry_run"])
    assert (
        code == 2
        and "got 1.4 (lopti_threshold from the config file" in err
        and str(tmp_path / "kk" / "bad.yaml") in err
    )
