"""`trl-lopti grpo --trainer_class` (and `rloo`): a user's own Lopti trainer, from a module in the working folder, everywhere
the command's own trainer goes. The module is the one docs/trainers/own.md writes (`my_trainers.py`); .ci/run trains it
from the wheel as one process and under a 2-process launch."""

import importlib
import re
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file


OWN_TRAINER_PAGE = Path(__file__).resolve().parents[1] / "docs" / "trainers" / "own.md"


def documented_module() -> str:
    """The `my_trainers.py` of docs/trainers/own.md, as written there."""
    return re.search(
        r"^```python\n# my_trainers\.py\n(.*?)^```", OWN_TRAINER_PAGE.read_text(), re.MULTILINE | re.DOTALL
    )[1]


@pytest.fixture
def users_folder(tmp_path, monkeypatch):
    """A working folder holding the documented `my_trainers.py` and a module of refused classes, as the current
    folder; the modules are imported afresh in each test."""
    (tmp_path / "my_trainers.py").write_text(documented_module())
    (tmp_path / "refused_trainers.py").write_text(
        "from trl import RLOOTrainer\nfrom trl.experimental.gmpo import GMPOTrainer\n\n"
        "from trl_lopti import LoptiGRPOTrainer, LoptiRLOOTrainer\n\n\n"
        "class LoptiPlainGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer): ...\n\n\n"
        "class LoptiMyRLOOTrainer(LoptiRLOOTrainer, RLOOTrainer): ...\n"
    )
    (tmp_path / "broken_trainers.py").write_text("raise RuntimeError('a bug in my module')\n")
    monkeypatch.chdir(tmp_path)
    for name in ("my_trainers", "refused_trainers", "broken_trainers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield tmp_path
    for name in ("my_trainers", "refused_trainers", "broken_trainers"):
        sys.modules.pop(name, None)
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


@pytest.fixture(scope="module")
def peaked_model_path(tmp_path_factory) -> str:
    """A tiny model whose sampled tokens fall on both sides of eta = 0.5, as the page's Python example builds it."""
    from trl_lopti.models import PEAKED_TINY_MODEL, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-peaked"), **PEAKED_TINY_MODEL)


@pytest.fixture
def train_flags(users_folder, peaked_model_path):
    """The flags of a two-step run on a local data file and the peaked tiny model, on the CPU."""
    rows = "".join(f'{{"prompt": "What is {i} + 2? The answer is"}}\n' for i in range(4))
    (users_folder / "prompts.jsonl").write_text(rows)
    return [
        "--dataset_name",
        "prompts.jsonl",
        "--reward_funcs",
        "token_parity_reward",
        "--model_name_or_path",
        peaked_model_path,
        "--use_cpu",
        "true",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--learning_rate",
        "1e-3",
    ]


def test_help_lists_the_fields_of_the_users_config_in_a_section_of_their_own(users_folder, run_cli):
    code, out, _ = run_cli(["grpo", "--trainer_class", "my_trainers.LoptiGMPOTrainer", "--help"])
    assert code == 0
    assert "train my_trainers.LoptiGMPOTrainer with LoptiGMPOConfig" in out
    section = out.split("LoptiGMPOConfig's own fields (in my_trainers):\n")[1].split("\n\n")[0]
    assert re.match(r"  --entropy_coef VALUE +Entropy bonus of LoptiEntropyGMPOTrainer\. \(default: 0\.0\)$", section)
    assert "Advantage Reweighting and Lopti (LoptiGMPOConfig)" in out and "GMPOConfig (" in out


def test_a_flag_and_a_yaml_key_set_the_users_field_and_the_dry_run_names_the_classes(
    users_folder, train_flags, run_cli
):
    import json

    config = users_folder / "run.yaml"
    config.write_text(yaml.safe_dump({"trainer_class": "my_trainers.LoptiEntropyGMPOTrainer", "entropy_coef": 0.02}))
    code, out, err = run_cli(["grpo", "--config", str(config), *train_flags, "--output_dir", "out", "--dry_run"])
    assert code == 0, err
    resolved = json.loads(out)
    assert resolved["trainer"] == "my_trainers.LoptiEntropyGMPOTrainer"
    assert resolved["config"] == "my_trainers.LoptiGMPOConfig"
    assert resolved["config_file"]["entropy_coef"] == 0.02
    # GMPO's own default, not GRPO's 0.2.
    assert resolved["defaults"]["epsilon"] == 0.4
    flags = ["--trainer_class", "my_trainers.LoptiEntropyGMPOTrainer", "--entropy_coef", "0.05"]
    code, out, err = run_cli(["grpo", *flags, *train_flags, "--output_dir", "out", "--dry_run"])
    assert code == 0, err
    assert json.loads(out)["flags"]["entropy_coef"] == 0.05


def test_a_preset_sets_its_values_over_the_users_config_and_the_run_says_which(users_folder, run_cli):
    flags = ["--trainer_class", "my_trainers.LoptiGMPOTrainer", "--beta", "0", "--dry_run"]
    code, _, err = run_cli(["grpo", "--config", "kk/qwen2.5-3b-instruct_ar_lopti", *flags])
    assert code == 0, err
    said = next(line for line in err.splitlines() if "fields over LoptiGMPOConfig's defaults" in line)
    assert "its own defaults replaced: epsilon 0.4 -> 0.2" in said
    assert said.endswith(
        "left out, at LoptiGRPOConfig's defaults, which LoptiGMPOConfig lacks: advantage_estimator 'grpo'"
    )
    # The preset's AR with its KL term, in a loss that is not TRL's token-level one: the trainer's refusal, in one line.
    code, _, err = run_cli(["grpo", "--config", "kk/qwen2.5-3b-instruct_ar_lopti", *flags[:2], "--dry_run"])
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith(
        "trl-lopti grpo: error: LoptiGMPOTrainer: advantage_reweighting_alpha=0.3"
    )
    assert "beta from the config file" in lines[-1]
    # A value the user's config has no field for, other than the command's default, would train another run.
    code, _, err = run_cli(["grpo", "--config", "kk/qwen2.5-3b-instruct_reinforce_pp_ar_lopti", *flags])
    assert code == 2
    assert "advantage_estimator (the config file" in err and "a field of LoptiGRPOConfig, which LoptiGMPOConfig" in err


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            ["--trainer_class", "broken_trainers.LoptiTrainer"],
            (
                "--trainer_class broken_trainers.LoptiTrainer: importing broken_trainers failed: RuntimeError: a bug in "
                "my module"
            ),
        ),
        (["--trainer_class", "my_trainers.Nope"], "--trainer_class my_trainers.Nope: my_trainers has no class Nope"),
        (["--trainer_class", "my_trainers"], "--trainer_class my_trainers: give MODULE.CLASS"),
        (
            ["--trainer_class", "my_trainers.GMPOTrainer"],
            (
                "--trainer_class my_trainers.GMPOTrainer: GMPOTrainer is not a Lopti trainer: compose it with one, Lopti "
                "class first, e.g. `class LoptiGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer)`, and give that class to "
                "trl-lopti grpo"
            ),
        ),
        (
            ["--trainer_class", "refused_trainers.LoptiMyRLOOTrainer"],
            (
                "--trainer_class refused_trainers.LoptiMyRLOOTrainer: LoptiMyRLOOTrainer is a LoptiRLOOTrainer, which "
                "trains with trl-lopti rloo, not trl-lopti grpo"
            ),
        ),
        (
            ["--trainer_class", "refused_trainers.LoptiPlainGMPOTrainer"],
            (
                "--trainer_class refused_trainers.LoptiPlainGMPOTrainer trains with a GMPOConfig, which holds no field of "
                "Advantage Reweighting and Lopti: define `@dataclass class LoptiGMPOConfig(trl_lopti.LoptiArguments, "
                "GMPOConfig)` in refused_trainers and give --config_class refused_trainers.LoptiGMPOConfig"
            ),
        ),
        (
            [
                "--trainer_class",
                "refused_trainers.LoptiPlainGMPOTrainer",
                "--config_class",
                "trl_lopti.LoptiGRPOConfig",
            ],
            (
                "--config_class trl_lopti.LoptiGRPOConfig: LoptiGRPOConfig does not fit LoptiPlainGMPOTrainer, which "
                "trains with a GMPOConfig: give a config of `@dataclass class LoptiGMPOConfig(trl_lopti.LoptiArguments, "
                "GMPOConfig)`"
            ),
        ),
        (
            ["--trainer_class", "my_trainers.LoptiGMPOTrainer", "--config_class", "trl.experimental.gmpo.GMPOConfig"],
            (
                "--config_class trl.experimental.gmpo.GMPOConfig: GMPOConfig does not fit LoptiGMPOTrainer, which trains "
                "with a LoptiGMPOConfig: give a LoptiGMPOConfig or a subclass of it"
            ),
        ),
        (
            ["--trainer_class", "my_trainers.LoptiGMPOTrainer", "--config_class", "trl.RLOOConfig"],
            "--config_class trl.RLOOConfig: RLOOConfig is not a config of GRPOConfig's family",
        ),
        (
            ["--trainer_class", "my_trainers.LoptiGMPOTrainer", "--entropy_coeff", "1"],
            "--entropy_coeff (a flag): no such option; did you mean --entropy_coef?",
        ),
        (
            ["--trainer_class", "my_trainers.LoptiGMPOTrainer", "--advantage_estimator", "grpo"],
            "--advantage_estimator (a flag): a field of LoptiGRPOConfig, which LoptiGMPOConfig does not have",
        ),
        (
            ["--trainer_class", "trl.RLOOTrainer"],
            (
                "--trainer_class trl.RLOOTrainer: RLOOTrainer is TRL's own trainer: trl-lopti rloo trains it with AR and "
                "Lopti (LoptiRLOOTrainer), with no --trainer_class"
            ),
        ),
        (
            ["--trainer_class", "my_trainers.LoptiGMPOConfig"],
            (
                "--trainer_class my_trainers.LoptiGMPOConfig: LoptiGMPOConfig is not a trainer (no subclass of TRL's "
                "GRPOTrainer or RLOOTrainer)"
            ),
        ),
        (
            ["--trainer_class", "trl_lopti.lopti_mixin.LoptiTrainerMixin"],
            "--trainer_class trl_lopti.lopti_mixin.LoptiTrainerMixin: LoptiTrainerMixin is not a trainer",
        ),
        (
            ["--config_class", "my_trainers.LoptiGMPOConfig"],
            (
                "--config_class my_trainers.LoptiGMPOConfig: LoptiGMPOConfig does not fit LoptiGRPOTrainer, which trains "
                "with a LoptiGRPOConfig: give a LoptiGRPOConfig or a subclass of it"
            ),
        ),
    ],
)
def test_each_failure_is_one_line_with_exit_code_2(users_folder, train_flags, run_cli, flags, expected):
    code, out, err = run_cli(["grpo", *flags, *train_flags, "--output_dir", "out", "--dry_run"])
    lines = [line for line in err.splitlines() if "no accelerator on this machine" not in line]
    assert code == 2 and out == "" and lines == [f"trl-lopti grpo: error: {lines[0].split(': error: ', 1)[1]}"]
    assert lines[0].split(": error: ", 1)[1].startswith(expected), lines[0]


def test_the_last_flag_wins_as_argparse_takes_it_and_equals_signs_work(users_folder, train_flags, run_cli):
    """A repeated `--trainer_class` names the class argparse keeps (the last), so the config read and the class trained
    are the same; `--trainer_class=X` and `--config=FILE` read as the spaced forms."""
    import json

    config = users_folder / "run.yaml"
    config.write_text(yaml.safe_dump({"entropy_coef": 0.03}))
    flags = [
        "--trainer_class",
        "trl_lopti.LoptiGRPOTrainer",
        "--trainer_class=my_trainers.LoptiEntropyGMPOTrainer",
        f"--config={config}",
    ]
    code, out, err = run_cli(["grpo", *flags, *train_flags, "--output_dir", "out", "--dry_run"])
    assert code == 0, err
    resolved = json.loads(out)
    assert resolved["trainer"] == "my_trainers.LoptiEntropyGMPOTrainer"
    assert resolved["config"] == "my_trainers.LoptiGMPOConfig"
    assert resolved["config_file"]["entropy_coef"] == 0.03


def test_the_help_of_demo_and_diagnose_still_lists_their_own_arguments(users_folder, run_cli):
    for command in ("demo", "diagnose"):
        code, out, _ = run_cli([command, "--help"])
        assert code == 0 and f"usage: trl-lopti {command}" in out, command
    code, _, err = run_cli(["diagnose", "--trainer_class", "my_trainers.LoptiGMPOTrainer", "--use_cpu", "true"])
    assert code == 2 and "trainer_class, config_class: options of trl-lopti grpo" in err


@pytest.mark.slow
def test_a_rehearsal_of_a_preset_trains_the_users_class_and_says_what_the_preset_sets_over_its_defaults(
    users_folder, run_cli, single_thread
):
    """`--config PRESET --trainer_class ... --rehearse`: one Lopti cycle of the user's class on a tiny model, a
    checkpoint between the passes and a resume from it, ending where the uninterrupted run ends."""
    flags = ["--trainer_class", "my_trainers.LoptiEntropyGMPOTrainer", "--entropy_coef", "0.01", "--beta", "0"]
    argv = ["grpo", "--config", "kk/qwen2.5-3b-instruct_ar_lopti", *flags, "--output_dir", "out", "--rehearse"]
    code, out, err = run_cli(argv)
    assert code == 0, out[-3000:] + err[-3000:]
    assert "trl-lopti grpo: training my_trainers.LoptiEntropyGMPOTrainer on cpu, 1 process" in out
    assert "over LoptiGMPOConfig's defaults" in out and "its own defaults replaced: epsilon 0.4 -> 0.2" in out
    assert "rehearse: trainer: LoptiEntropyGMPOTrainer" in out and "rehearse: failures: []" in out
    assert "rehearse: resume_max_abs_difference: 0.0" in out


def test_rloo_takes_a_users_rloo_trainer(users_folder, train_flags, run_cli):
    import json

    flags = ["--trainer_class", "refused_trainers.LoptiMyRLOOTrainer", *train_flags, "--output_dir", "out"]
    code, out, err = run_cli(["rloo", *flags, "--dry_run"])
    assert code == 0, err
    assert json.loads(out)["trainer"] == "refused_trainers.LoptiMyRLOOTrainer"
    assert json.loads(out)["config"] == "trl_lopti.config.LoptiRLOOConfig"


@pytest.mark.slow
def test_a_users_loss_trains_through_the_command_line_and_its_field_changes_the_update(
    users_folder, train_flags, run_cli, peaked_model_path, single_thread
):
    """Two optimizer steps (one Lopti cycle) of the documented loss of one's own: the run's first line names the class,
    the model moves, and the user's field changes the update (the loss is the user's, not GMPO's alone)."""
    trained = {}
    # The same run twice first: what the bonus changes is no run-to-run noise.
    for run, entropy_coef in (("first", "0.0"), ("again", "0.0"), ("bonus", "0.5")):
        flags = ["--trainer_class", "my_trainers.LoptiEntropyGMPOTrainer", "--entropy_coef", entropy_coef]
        output_dir = users_folder / f"out-{run}"
        code, out, err = run_cli(["grpo", *flags, *train_flags, "--output_dir", str(output_dir)])
        assert code == 0, err
        first = next(line for line in out.splitlines() if line.startswith("trl-lopti grpo:"))
        assert first == "trl-lopti grpo: training my_trainers.LoptiEntropyGMPOTrainer on cpu, 1 process"
        trained[run] = load_file(output_dir / "model.safetensors")
    initial = load_file(Path(peaked_model_path) / "model.safetensors")
    moved = max(float((trained["first"][k] - initial[k]).abs().max()) for k in initial)
    by_chance = max(float((trained["again"][k] - trained["first"][k]).abs().max()) for k in initial)
    by_the_bonus = max(float((trained["bonus"][k] - trained["first"][k]).abs().max()) for k in initial)
    assert moved > 1e-4 and by_chance == 0.0 and by_the_bonus > 1e-6, (moved, by_chance, by_the_bonus)
    assert importlib.import_module("my_trainers").__file__ == str(users_folder / "my_trainers.py")
