"""`trl-lopti`: the commands, parsing (presets, YAML + flags, `None`), the help, errors that name the field, the nearest
real name and where a bad value came from (exit code 2), the dry run, the datasets of each task, and real training runs
from a YAML file."""

import ast
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from trl_lopti.cli import CliError
from trl_lopti.cli.parsing import CONFIGS as TRAINERS
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

    code, out, _ = run_cli([])  # `trl-lopti` alone lists the commands, as `trl` alone does
    listed = re.findall(r"^  (\w+) ", out.split("commands:")[1], re.MULTILINE)
    assert code == 0 and listed == ["grpo", "rloo", "presets", "demo", "diagnose", "check"]
    assert run_cli(["--help"]) == (0, out, "")
    code, _, err = run_cli(["grop"])
    assert code == 2 and "no command 'grop'; did you mean grpo?" in err
    assert run_cli(["--version"])[:2] == (0, f"trl-lopti {__version__}\n")


def imports_of_the_cli() -> dict[str, set[str]]:
    """The modules of trl_lopti/cli that each of its modules imports: at its top or in a function, by an import
    statement or `importlib.import_module`, and, for `main`, the modules of its commands (which it imports by name)."""
    from trl_lopti.cli.base import COMMANDS

    folder = REPO / "trl_lopti" / "cli"
    modules = {path.stem for path in folder.glob("*.py")}
    graph = {}
    for path in folder.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module} if node.module else {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.removeprefix("trl_lopti.cli.").split(".")[0])
            elif isinstance(node, ast.Import):
                imported |= {alias.name.removeprefix("trl_lopti.cli.").split(".")[0] for alias in node.names}
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
                name = node.args[0].value if isinstance(node.args[0], ast.Constant) else ""
                imported.add(name.removeprefix("trl_lopti.cli").lstrip(".").split(".")[0])
        graph[path.stem] = imported & modules
    graph["main"] |= {target.split(":")[0] for target, _ in COMMANDS.values()} & modules
    return graph


def test_the_modules_of_the_cli_import_one_way():
    """No circle: main -> each command's module -> parsing -> preset_files -> base (`presets` imports `train` for its
    dry run, `train` never imports `presets`; `rehearse` imports `train`, which never imports `rehearse`)."""
    from graphlib import CycleError, TopologicalSorter

    graph = imports_of_the_cli()
    assert graph["base"] == set() and graph["main"] >= {"base", "train_command", "presets", "demo", "diagnose"}
    assert graph["presets"] >= {"preset_files", "train"} and graph["rehearse"] >= {"parsing", "train"}
    assert graph["train_command"] >= {"train", "rehearse"} and "preset_files" in graph["parsing"]
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as error:
        pytest.fail(f"modules of trl_lopti/cli import each other in a circle: {' -> '.join(error.args[1])}")
    assert order[0] == "base" and order[-2:] == ["main", "__init__"]
    # What the check finds if `train` imported `rehearse` again.
    with pytest.raises(CycleError):
        list(TopologicalSorter({**graph, "train": graph["train"] | {"rehearse"}}).static_order())


def test_presets_path_prints_the_installed_launcher_or_preset_from_any_folder(run_cli, tmp_path):
    """`accelerate launch --config_file "$(trl-lopti presets --path accelerate/fsdp2)" ...` from an installed package:
    the path alone on stdout, without loading TRL."""
    from trl_lopti.cli.preset_files import PRESETS

    for name, file in [
        ("accelerate/fsdp2", "accelerate/fsdp2.yaml"),
        ("accelerate/zero3.yaml", "accelerate/zero3.yaml"),
        ("kk/qwen2.5-3b-instruct_ar_lopti", "kk/qwen2.5-3b-instruct_ar_lopti.yaml"),
    ]:
        code, out, _ = run_cli(["presets", "--path", name])
        assert code == 0 and out == f"{PRESETS / file}\n" and Path(out.strip()).is_file()
    code, out, err = run_cli(["presets", "--path", "accelerate/fsdp"])
    expected = (
        "--path: no file accelerate/fsdp, nor a preset or a launcher of that name; did you mean accelerate/fsdp2?"
    )
    assert code == 2 and out == "" and err == f"trl-lopti presets: error: {expected}\n"
    # From another folder, in a new process: the path, and no TRL imported.
    script = "import sys; from trl_lopti.cli import main; main(['presets', '--path', 'accelerate/fsdp2']); "
    script += "print('trl' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60, check=False
    )
    assert result.returncode == 0 and result.stdout == f"{PRESETS / 'accelerate/fsdp2.yaml'}\nFalse\n", result.stderr


def test_help_fits_a_screen_with_config_and_the_lopti_fields_first_and_help_all_lists_every_field(run_cli):
    code, out, _ = run_cli(["grpo", "--help"])
    lines = out.splitlines()
    assert code == 0 and len(lines) <= 55 and max(map(len, lines)) <= 119
    options = re.findall(r"^  (--\w+|-h)", out, re.MULTILINE)
    assert options[:4] == ["--config", "--help_all", "-h", "--task"] and "--lopti-threshold" not in out
    lopti = out.index("Advantage Reweighting and Lopti (LoptiGRPOConfig):")
    assert options[-5:] == [
        "--advantage_reweighting_alpha",
        "--lopti_threshold",
        "--lopti_quantile",
        "--lopti_order",
    ] + ["--advantage_estimator"]
    assert lopti < out.index("GRPOConfig (191): --output_dir") and "ModelConfig (19): --model_name_or_path" in out
    code, everything, _ = run_cli(["grpo", "--help_all"])
    assert code == 0 and len(everything.splitlines()) > 1000
    from trl import ModelConfig

    from trl_lopti import LoptiGRPOConfig

    for config_class in (LoptiGRPOConfig, ModelConfig):  # every field of every dataclass
        missing = [f.name for f in dataclasses.fields(config_class) if f.init and f"--{f.name} " not in everything]
        assert missing == [], missing
    assert run_cli(["rloo", "--help"])[1].count("(LoptiRLOOConfig):") == 1


def test_the_help_of_a_no_flag_says_what_it_does(run_cli):
    """transformers' parser adds `--no_FIELD` for a bool field that defaults to True, with the field's own help: each
    says what it does, and the `--no_` flag shows no default of its own (False, which is not the field's)."""
    from trl_lopti.cli.train import train_parser

    code, out, _ = run_cli(["grpo", "--help"])
    shown = " ".join(out.split())
    assert (
        code == 0
        and "--kk_prefill_think [VALUE] End K&K prompts with an assistant '<think>'. (default: True)" in shown
    )
    assert (
        "--no_kk_prefill_think The opposite of --kk_prefill_think: sets kk_prefill_think to False. --kk_data_dir"
        in shown
    )
    everything = " ".join(run_cli(["grpo", "--help_all"])[1].split())
    assert (
        "--no-kk-prefill-think The opposite of --kk_prefill_think: sets kk_prefill_think to False. --kk_data_dir"
        in everything
    )
    no_flags = {
        action.option_strings[0]: action.help
        for action in train_parser("grpo")._actions
        if action.option_strings[0].startswith("--no_")
    }
    assert len(no_flags) > 5 and "--no_gradient_checkpointing" in no_flags
    for flag, help_text in no_flags.items():
        assert help_text == f"The opposite of --{flag[5:]}: sets {flag[5:]} to False.", (flag, help_text)
    assert parse_train_args(["--use_cpu", "true", "--no_kk_prefill_think"])[0].kk_prefill_think is False
    assert parse_train_args(["--use_cpu", "true"])[0].kk_prefill_think is True


@pytest.mark.parametrize("command", ["grpo", "rloo", "diagnose"])
def test_a_command_without_arguments_says_what_it_needs_with_an_example(run_cli, command):
    """What `make demo` does to `demo` (tests/test_demo.py): the command with an empty argument list."""
    code, out, err = run_cli([command])
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"trl-lopti {command}: error: needs ") and f"\n  trl-lopti {command} --" in err, err


def test_python_dash_m_runs_the_cli(tmp_path, base):
    """`python -m trl_lopti` (what `accelerate launch -m trl_lopti` runs) reaches the same CLI."""
    config = write_yaml(tmp_path / "c.yaml", {**base, "lopti_threshold": None})
    result = subprocess.run(
        [sys.executable, "-m", "trl_lopti", "grpo", "--config", config, "--dry_run", "--learning_rate", "3e-6"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout[result.stdout.index("{\n") :])  # after any banner a library prints on import
    assert resolved["flags"]["learning_rate"] == 3e-6 and resolved["lopti"]["lopti_threshold"] is None
    assert resolved["config_file"]["model_name_or_path"] == base["model_name_or_path"]


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


def test_dry_run_prints_every_field_once_by_where_it_came_from_and_loads_nothing(tmp_path, base, run_cli):
    """Every field of the three dataclasses, as parsed (JSON: `accelerator_config` a mapping, not a repr), in one group
    each: the config file, flags, this machine's CPU settings or a default; and the completions per process and on all
    processes of the launch."""
    from trl import ModelConfig

    from trl_lopti import LoptiGRPOConfig
    from trl_lopti.cli.train import LoptiScriptArguments

    values = {**base, "kk_num_people": [2, 3], "kk_num_samples": 7, "beta": 0.01, "steps_per_generation": 4}
    config = write_yaml(tmp_path / "c.yaml", {key: value for key, value in values.items() if key != "use_cpu"})
    code, out, err = run_cli(["grpo", "--config", config, "--dry_run", "--use_peft", "true", "--lora_r", "4"])
    assert code == 0, err
    resolved = json.loads(out)
    groups = ("config_file", "flags", "this_machine", "defaults")
    assert list(resolved) == [
        "command",
        "trainer",
        "config",
        "device",
        "completions",
        "reward_funcs",
        "lopti",
        *groups,
    ]
    assert resolved["trainer"] == "trl_lopti.grpo_trainer.LoptiGRPOTrainer"
    assert resolved["config"] == "trl_lopti.config.LoptiGRPOConfig"
    names = [name for group in groups for name in resolved[group]]
    everything = [
        f.name for cls in (LoptiScriptArguments, LoptiGRPOConfig, ModelConfig) for f in dataclasses.fields(cls)
    ]
    assert sorted(names) == sorted(name for name in everything if name != "trainer")  # each once
    assert resolved["config_file"] == {key: value for key, value in values.items() if key != "use_cpu"}
    assert resolved["flags"] == {"use_peft": True, "lora_r": 4, "dry_run": True}
    cpu = not torch.accelerator.is_available()
    assert resolved["this_machine"] == ({"use_cpu": True} if cpu else {})
    assert resolved["defaults"]["learning_rate"] == LoptiGRPOConfig.learning_rate  # (TRL's 1e-6)
    assert isinstance(resolved["defaults"]["accelerator_config"], dict)
    assert resolved["device"].startswith("cpu, 1 process(es)" if cpu else "cuda")
    per_process = {"micro_step": 8, "optimizer_step": 8, "generation_batch": 32}  # TRL's default batch of 8
    assert resolved["completions"] == {
        "per_process": per_process,
        "all_processes": per_process,  # one process
        "prompts_per_generation_batch": 32 // 8,
    }
    assert resolved["reward_funcs"] == ["knights_knaves_reward"]
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
        code, _, err = run_cli(["grpo", "--config", str(path)])
        assert code == 2 and str(path) in err, err
    code, _, err = run_cli(["grpo", "--config"])
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
def test_bad_values_name_the_field_and_the_file_before_loading_anything(tmp_path, base, run_cli, values, field):
    config = write_yaml(tmp_path / "bad.yaml", {**base, **values})
    code, _, err = run_cli(["grpo", "--config", config, "--dry_run"])
    assert code == 2 and field in err and config in err, err
    if field != "learnig_rate":  # (a value of the file, or the default of a field the file's task needs)
        assert f"{field} from the config file {config}" in err or f"{field} from its default" in err, err


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ["--task", "sudoku"],
            "task: must be one of ['knights_knaves', 'math', 'dataset'], got 'sudoku' (task from the flag --task)",
        ),
        (["--beta", "x"], "argument --beta: invalid float value: 'x' (beta from the flag --beta)"),
        (["--lopti_threshold", "1.2"], "got 1.2 (lopti_threshold from the flag --lopti_threshold)"),
        (["--lopti_treshold", "0.4"], "--lopti_treshold (a flag): no such option; did you mean --lopti_threshold?"),
        (["--eta", "0.5"], "--eta (a flag): no such option"),
        (["--task", "math"], "dataset_name: task 'math' takes one of"),  # and the default dataset_name, below
    ],
)
def test_a_bad_flag_names_the_flag_the_nearest_real_one_or_where_each_value_came_from(
    tmp_path, base, run_cli, flags, error
):
    """A flag's value is blamed on the flag, not on the config file, which sets the same field to a good value."""
    config = write_yaml(tmp_path / "ok.yaml", {**base, "lopti_threshold": 0.5, "beta": 0.0})
    code, _, err = run_cli(["grpo", "--config", config, "--dry_run", *flags])
    assert code == 2 and error in err and "Traceback" not in err, err
    if flags[0] == "--task":  # each field the error names, with its origin
        origins = (
            "(task from the flag --task)"
            if flags[1] == "sudoku"
            else "(dataset_name from its default; task from the flag --task)"
        )
        assert err.strip().endswith(origins), err


def test_a_misspelt_key_gets_the_nearest_real_one_and_the_other_trainers_key_its_command(tmp_path, base, run_cli):
    config = write_yaml(tmp_path / "typo.yaml", {**base, "lopti_treshold": 0.4})
    code, _, err = run_cli(["grpo", "--config", config])
    assert (
        code == 2 and f"lopti_treshold (the config file {config}): no such field; did you mean lopti_threshold?" in err
    )
    assert "dataclass" not in err and "fail_with_unknown_args" not in err  # TRL's advice to a parser's author


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


@pytest.mark.parametrize("where", ["prompts.jsonl", "./prompts.jsonl", "data/prompts.jsonl", "absolute"])
def test_a_data_file_loads_by_a_bare_name_a_dot_path_a_subfolder_or_an_absolute_path(
    tmp_path, base, monkeypatch, where
):
    """`--dataset_name prompts.jsonl` in the current folder (its parent "." once read as no folder at all)."""
    rows = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(3)]
    (tmp_path / "data").mkdir()
    for path in (tmp_path / "prompts.jsonl", tmp_path / "data" / "prompts.jsonl"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(tmp_path)
    name = str(tmp_path / "data" / "prompts.jsonl") if where == "absolute" else where
    reward = "trl_lopti.tasks.arithmetic.exact_answer_reward"
    config = write_yaml(
        tmp_path / "d.yaml", {**base, "task": "dataset", "dataset_name": name, "reward_funcs": [reward]}
    )
    train, evaluation = build_datasets(*parse_train_args(["--config", config])[:2])
    assert train.to_list() == rows and evaluation is None


REWARD = "trl_lopti.tasks.arithmetic.exact_answer_reward"


@pytest.fixture
def prompts(tmp_path, monkeypatch) -> Path:
    """A data file of the user's, `prompts.jsonl`, in the current folder."""
    rows = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(3)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "prompts.jsonl"


def test_a_dataset_name_without_a_task_is_the_users_data_as_in_trl(base, prompts):
    """`trl-lopti grpo --dataset_name prompts.jsonl --reward_funcs ...`, no `--task`: the user's data, as `trl grpo`
    reads it; without a dataset name, or with the name of the paper's data or a K&K source, the paper's task."""
    flags = ["--model_name_or_path", base["model_name_or_path"], "--use_cpu", "true"]
    script_args, training_args, _ = parse_train_args(
        [*flags, "--dataset_name", "prompts.jsonl", "--reward_funcs", REWARD]
    )
    assert script_args.task == "dataset"
    train, _ = build_datasets(script_args, training_args)
    assert train.to_list() == [json.loads(line) for line in prompts.read_text().splitlines()]
    tasks_of = {
        (): "knights_knaves",
        ("--dataset_name", "K-and-K/knights-and-knaves"): "knights_knaves",
        ("--dataset_name", "me/my-kk-copy", "--kk_source", "hub"): "knights_knaves",
        ("--dataset_name", "dsr_uniform"): "math",
        ("--dataset_name", "me/my-prompts", "--reward_funcs", REWARD): "dataset",
    }
    for given, task in tasks_of.items():
        assert parse_train_args([*flags, *given])[0].task == task, given
    # Every preset names its task, which its dataset name does not change (`make presets` checks them all).
    for preset in sorted((REPO / "configs").glob("[!a]*/*.yaml")):
        values = yaml.safe_load(preset.read_text())
        parsed = parse_train_args(["--config", str(preset), "--dry_run"], values.get("trainer", "grpo"))
        assert parsed[0].task == values["task"], preset


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ["--dataset_name", "missing.jsonl", "--reward_funcs", REWARD],
            "dataset_name: no file or folder 'missing.jsonl' in {cwd} (task 'dataset'; --task dataset reads your data",
        ),
        (
            ["--dataset_name", "./data/missing", "--reward_funcs", REWARD],
            "dataset_name: no file or folder './data/missing' in {cwd}",
        ),
        (
            ["--task", "knights_knaves", "--dataset_name", "prompts.jsonl"],
            (
                "dataset_name: 'prompts.jsonl' is your data, not K&K puzzles (task 'knights_knaves' reads them from "
                "the hub, the paper or the generator, see kk_source): train on it with --task dataset"
            ),
        ),
        (["--task", "math", "--dataset_name", "prompts.jsonl"], "task 'math' takes one of"),
    ],
)
def test_a_dataset_name_that_cannot_work_fails_at_once_naming_task_dataset(base, prompts, run_cli, flags, error):
    """Refused as it is parsed, before any data or model loads: no look-up of a local path on the Hub, which retries
    for about 30 s before it fails (`datasets.load_dataset` is never reached)."""
    start = time.perf_counter()
    code, _, err = run_cli(["grpo", "--model_name_or_path", base["model_name_or_path"], "--use_cpu", "true", *flags])
    assert code == 2 and error.format(cwd=prompts.parent) in err and "--task dataset" in err, err
    assert "(dataset_name from the flag --dataset_name" in err and time.perf_counter() - start < 10


def test_a_hub_id_is_still_read_from_the_hub(base, monkeypatch):
    """A name that may be a hub id (`owner/name`, no data file extension) goes to `datasets.load_dataset`, as in
    `trl grpo` (stood in for here: the tests run offline)."""
    import datasets

    loaded = []
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda *args, **kwargs: loaded.append(args) or datasets.Dataset.from_list([{"prompt": "x"}]),
    )
    flags = ["--model_name_or_path", base["model_name_or_path"], "--use_cpu", "true", "--reward_funcs", REWARD]
    train, _ = build_datasets(*parse_train_args([*flags, "--dataset_name", "trl-lib/DeepMath-103K"])[:2])
    assert loaded == [("trl-lib/DeepMath-103K", None)] and train.to_list() == [{"prompt": "x"}]


@pytest.mark.parametrize(
    "name, text, error",
    [
        ("empty.jsonl", "", "dataset_name: the data file {path} is empty"),
        ("blank.jsonl", "\n\n", "dataset_name: cannot read the data file {path}: it holds only blank lines"),
        (
            "broken.jsonl",
            '{"prompt": "a"}\n{"prompt": "b"\n',
            "dataset_name: cannot read the data file {path}: line 2 is not JSON: Expecting ',' delimiter (column 15)",
        ),
        (
            "text.jsonl",
            '{"prompt": "a"}\n\nnot json\n',
            "dataset_name: cannot read the data file {path}: line 3 is not JSON: Expecting value (column 1)",
        ),
        (
            "document.json",
            '[\n  {"prompt": "a"},\n  {"prompt": "b"}\n  {"prompt": "c"}\n]\n',
            "dataset_name: cannot read the data file {path}: line 4 is not JSON: Expecting ',' delimiter (column 3)",
        ),
        (
            "broken.csv",
            'prompt,answer\n"a,1\n',
            (
                "dataset_name: cannot read the data file {path}: Error tokenizing data. C error: EOF inside string "
                "starting at row 1"
            ),
        ),
    ],
)
def test_an_empty_or_malformed_data_file_is_an_error_that_names_it(tmp_path, base, run_cli, name, text, error):
    path = tmp_path / name
    path.write_text(text)
    argv = ["grpo", "--model_name_or_path", base["model_name_or_path"], "--output_dir", base["output_dir"]]
    code, _, err = run_cli([*argv, "--use_cpu", "true", "--dataset_name", str(path), "--reward_funcs", REWARD])
    assert code == 2 and err.splitlines()[-1] == f"trl-lopti grpo: error: {error.format(path=path)}", err
    assert "Traceback" not in err
    # Refused before any model loads.
    assert not Path(base["output_dir"]).exists()


# ---------------------------------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------------------------------
def test_train_from_yaml_with_lora(tmp_path, base, run_cli):
    """`trl-lopti grpo --config` trains a tiny model with LoRA, AR and Lopti on a local dataset, and saves it."""
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
    code, out, err = run_cli(["grpo", "--config", write_yaml(tmp_path / "train.yaml", values)])
    assert code == 0, err
    # Where it trains: said first, once.
    assert out.splitlines()[0] == "trl-lopti grpo: training on cpu, 1 process"
    assert out.count("training on") == 1 and f"trl-lopti grpo: model saved to {base['output_dir']}" in out
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
    result = run_command("grpo", "--config", preset, "--rehearse", "--output_dir", str(tmp_path / "kk"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert cpu_notices(result.stderr) == [
        "trl-lopti grpo --rehearse: no accelerator on this machine, CPU settings: --use_cpu=True"
    ]
    assert json.loads((tmp_path / "kk-rehearsal" / "rehearsal.json").read_text())["failures"] == []


@pytest.mark.skipif(torch.accelerator.is_available(), reason="what a machine without an accelerator does")
def test_training_does_not_fall_back_to_the_cpu_and_names_the_flag(tmp_path, tiny_model_path):
    preset = str(REPO / "configs/kk/qwen2.5-3b-instruct_ar_lopti.yaml")
    argv = ["grpo", "--config", preset, "--model_name_or_path", tiny_model_path, "--output_dir", str(tmp_path / "kk")]
    result = run_command(*argv, cwd=tmp_path)
    assert result.returncode == 2
    assert "use_cpu" in result.stderr and "--use_cpu true" in result.stderr and cpu_notices(result.stderr) == []
    assert not (tmp_path / "kk").exists()


# ---------------------------------------------------------------------------------------------------------------------
# The trainer is the command: `trl-lopti grpo` (LoptiGRPOConfig) or `trl-lopti rloo` (LoptiRLOOConfig), as `trl grpo`,
# `trl rloo`; a config's `trainer:` key is a check, and a field of the other trainer an error naming its command
# ---------------------------------------------------------------------------------------------------------------------
def test_each_training_command_reads_its_trainers_config(tmp_path, base, run_cli):
    from trl_lopti import LoptiGRPOConfig, LoptiRLOOConfig

    rloo = write_yaml(tmp_path / "rloo.yaml", {**base, "trainer": "rloo", "normalize_advantages": True, "beta": 0.1})
    _, training_args, _ = parse_train_args(["--config", rloo], "rloo")
    assert type(training_args) is LoptiRLOOConfig and training_args.normalize_advantages is True
    assert training_args.beta == 0.1 and not hasattr(training_args, "advantage_estimator")
    plain = write_yaml(tmp_path / "plain.yaml", base)
    assert type(parse_train_args(["--config", plain])[1]) is LoptiGRPOConfig
    assert parse_train_args([f"--config={rloo}"], "rloo")[1].beta == 0.1  # as argparse takes any option's value
    assert type(parse_train_args(["--config", plain, "--epsilon_high=0.3"], "rloo")[1]) is LoptiRLOOConfig
    code, out, err = run_cli(["rloo", "--config", rloo, "--dry_run"])
    assert code == 0, err
    resolved = json.loads(out)
    assert resolved["command"] == "trl-lopti rloo" and "advantage_estimator" not in resolved["lopti"]
    assert resolved["config_file"]["normalize_advantages"] is True and "trainer" not in resolved["config_file"]


@pytest.mark.parametrize(
    "command, values, flags, error",
    [  # (the messages, with `{config}` for the config file's path)
        ("grpo", {"trainer": "rloo"}, [], "trainer: {config} is for `trl-lopti rloo`, not trl-lopti grpo"),
        ("rloo", {"trainer": "grpo"}, [], "trainer: {config} is for `trl-lopti grpo`, not trl-lopti rloo"),
        (
            "grpo",
            {"normalize_advantages": True},
            [],
            (
                "normalize_advantages (the config file {config}): a field of "
                "LoptiRLOOConfig, which `trl-lopti rloo` reads"
            ),
        ),
        (
            "grpo",
            {},
            ["--reward_clip_range", "0", "1"],
            "--reward_clip_range (a flag): a field of LoptiRLOOConfig, which `trl-lopti rloo` reads",
        ),
        (
            "rloo",
            {"loss_type": "bnpo"},
            [],
            "loss_type (the config file {config}): a field of LoptiGRPOConfig, which `trl-lopti grpo` reads",
        ),
        ("rloo", {}, ["--delta=10"], "--delta (a flag): a field of LoptiGRPOConfig, which `trl-lopti grpo` reads"),
        (
            "grpo",
            {},
            ["--trainer", "rloo"],
            "--trainer (a flag): the trainer is the command: trl-lopti grpo or trl-lopti rloo",
        ),
        (
            "rloo",
            {},
            ["--advantage_estimator", "grpo"],
            "--advantage_estimator (a flag): a field of LoptiGRPOConfig, which `trl-lopti grpo` reads",
        ),
        ("grpo", {}, ["--beta_", "0.1"], "--beta_ (a flag): no such option; did you mean --beta?"),  # no abbreviation
        ("demo", {"trainer": "rloo"}, [], "trainer: {config} is for `trl-lopti rloo`, not trl-lopti demo"),
        (
            "diagnose",
            {},
            ["--normalize_advantages", "true"],
            "--normalize_advantages (a flag): a field of LoptiRLOOConfig, which `trl-lopti rloo` reads",
        ),
    ],
)
def test_a_field_or_config_of_the_other_trainer_names_the_command_that_takes_it(
    tmp_path, base, run_cli, command, values, flags, error
):
    config = write_yaml(tmp_path / "c.yaml", {**base, **values})
    code, _, err = run_cli([command, "--config", config, *(["--dry_run"] if command in TRAINERS else []), *flags])
    assert code == 2 and error.format(config=config) in err, err
    assert not (tmp_path / "out").exists()


def test_train_is_grpo_under_its_former_name_and_says_so_once(tmp_path, base, run_cli):
    config = write_yaml(tmp_path / "c.yaml", base)
    code, out, err = run_cli(["train", "--config", config, "--dry_run"])
    assert code == 0 and json.loads(out)["command"] == "trl-lopti grpo"
    assert err.count("trl-lopti train: now `trl-lopti grpo` (`trl-lopti rloo` for RLOO), which runs") == 1
    assert "train" not in re.findall(r"^  (\w+) ", run_cli([])[1], re.MULTILINE)  # not listed


@pytest.mark.slow
@pytest.mark.skipif(torch.accelerator.is_available(), reason="what a machine without an accelerator does")
def test_rehearsal_of_the_rloo_preset_trains_rloo_through_both_passes_and_resumes(tmp_path):
    """The RLOO preset (not the paper's) as a user checks it: a dry run, then a rehearsal with LoptiRLOOTrainer."""
    preset = str(REPO / "configs/kk/qwen2.5-3b-instruct_rloo_ar_lopti.yaml")
    dry_run = run_command("rloo", "--config", "kk/qwen2.5-3b-instruct_rloo_ar_lopti", "--dry_run", cwd=tmp_path)
    assert dry_run.returncode == 0, dry_run.stderr[-3000:]
    resolved = json.loads(dry_run.stdout[dry_run.stdout.index("{\n") :])
    assert resolved["command"] == "trl-lopti rloo" and "advantage_estimator" not in resolved["lopti"]
    result = run_command("rloo", "--config", preset, "--rehearse", "--output_dir", str(tmp_path / "kk"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "kk-rehearsal" / "rehearsal.json").read_text())
    assert report["trainer"] == "LoptiRLOOTrainer" and report["failures"] == [] and report["eta"] == [0.5]
    assert report["low_pass_steps"] == [1, 2] and report["high_pass_steps"] == [3, 4]  # one Lopti cycle
    assert 0.0 < report["low_token_share"][0] < 1.0
    assert min(report["low_pass_grad_norms"] + report["high_pass_grad_norms"]) > 0
    assert report["checkpoint"].endswith("(with lopti_generation_batch_rank0.pt)")
    assert report["resume_max_abs_difference"] <= 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# What a user can get wrong ends in one line, `trl-lopti COMMAND: error: ...`, and exit code 2, never a traceback
# ---------------------------------------------------------------------------------------------------------------------
def error_line(result: subprocess.CompletedProcess, command: str = "grpo") -> str:
    """The error a finished `python -m trl_lopti COMMAND ...` printed: exit code 2, no traceback, the last line of its
    stderr, `trl-lopti COMMAND: error: ` taken off."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"trl-lopti {command}: error: "), result.stderr[-3000:]
    return last.removeprefix(f"trl-lopti {command}: error: ")


def checkpoint_folder(path: Path) -> Path:
    """An empty stand-in for a checkpoint: a folder with a `trainer_state.json`."""
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    return path


def test_resume_from_checkpoint_true_is_the_latest_checkpoint_in_output_dir_and_false_is_none(base, run_cli):
    """`--resume_from_checkpoint true` resumes as `Trainer.train(resume_from_checkpoint=True)` does, from the
    checkpoint-N folder of output_dir with the largest N; `--dry_run` shows the folder. Without one, a value that is
    no checkpoint folder (`true` once reached the trainer as a path), a one-line error before anything loads."""
    output_dir = Path(base["output_dir"])
    argv = ["grpo", "--model_name_or_path", base["model_name_or_path"], "--output_dir", str(output_dir), "--dry_run"]
    argv += ["--use_cpu", "true"]
    code, _, err = run_cli([*argv, "--resume_from_checkpoint", "true"])
    assert code == 2 and err == (
        "trl-lopti grpo: error: resume_from_checkpoint: true resumes from the latest checkpoint-N folder in "
        f"output_dir, and {output_dir} holds none: train without it first, or name a checkpoint folder "
        "(resume_from_checkpoint from the flag --resume_from_checkpoint; output_dir from the flag --output_dir)\n"
    )
    (output_dir / "checkpoint-7").mkdir(parents=True)
    code, _, err = run_cli([*argv, "--resume_from_checkpoint", "true"])
    assert code == 2 and err.startswith(
        f"trl-lopti grpo: error: resume_from_checkpoint: '{output_dir / 'checkpoint-7'}' is no checkpoint folder (it "
        "holds no trainer_state.json): name a checkpoint-N folder that a run saved, or true for the latest one in "
        "output_dir (resume_from_checkpoint from the flag --resume_from_checkpoint"
    )
    # By step, not by name: checkpoint-10 is later than checkpoint-9.
    checkpoint_folder(output_dir / "checkpoint-9")
    latest = checkpoint_folder(output_dir / "checkpoint-10")
    for value in ("true", "True"):
        code, out, err = run_cli([*argv, "--resume_from_checkpoint", value])
        assert code == 0 and json.loads(out)["flags"]["resume_from_checkpoint"] == str(latest), err
    code, out, _ = run_cli([*argv, "--resume_from_checkpoint", str(output_dir / "checkpoint-9")])
    assert code == 0 and json.loads(out)["flags"]["resume_from_checkpoint"] == str(output_dir / "checkpoint-9")
    code, out, _ = run_cli([*argv, "--resume_from_checkpoint", "false"])
    assert code == 0 and json.loads(out)["flags"]["resume_from_checkpoint"] is None


def test_a_resume_the_checkpoint_does_not_fit_is_one_line(base, run_cli, single_thread):
    """A checkpoint taken inside a generation batch, resumed (`true`: the latest) with another schedule, and a
    checkpoint folder without weights: the trainer's `ValueError` while it loads the checkpoint, as one line."""
    output_dir = Path(base["output_dir"])
    argv = ["grpo", "--model_name_or_path", base["model_name_or_path"], "--output_dir", str(output_dir)]
    argv += ["--use_cpu", "true", "--kk_num_samples", "4", "--per_device_train_batch_size", "2", "--num_generations"]
    argv += ["2", "--max_completion_length", "4", "--save_steps", "1", "--report_to", "none"]
    # One optimizer step: the low pass of the first generation batch's Lopti cycle.
    code, _, err = run_cli([*argv, "--max_steps", "1"])
    assert code == 0 and (output_dir / "checkpoint-1" / "lopti_generation_batch_rank0.pt").is_file(), err
    resumed = [*argv, "--max_steps", "2", "--resume_from_checkpoint", "true"]
    code, _, err = run_cli([*resumed, "--advantage_reweighting_alpha", "0.2"])
    assert code == 2 and err.splitlines()[-1] == (
        f"trl-lopti grpo: error: resume_from_checkpoint: {output_dir / 'checkpoint-1'} was saved inside a generation "
        "batch with advantage_reweighting_alpha=0.3; this run has advantage_reweighting_alpha=0.2: resume it with the "
        "values it was saved with, or from a checkpoint between generation batches"
    )
    empty = checkpoint_folder(output_dir / "checkpoint-2")
    code, _, err = run_cli(resumed)
    assert code == 2 and err.splitlines()[-1] == (
        f"trl-lopti grpo: error: resume_from_checkpoint: Can't find a valid checkpoint at {empty}"
    )


def test_only_a_value_error_of_a_checkpoint_being_loaded_is_a_resume_error():
    """The narrow rule that makes a `ValueError` of `Trainer.train` a user's error: raised inside a method that
    loads the checkpoint (`train.RESUME_STEPS`), by it or below it; any other stays a traceback."""
    from trl_lopti.cli.train import RESUME_STEPS, raised_while_resuming

    def _load_optimizer_and_scheduler():
        raise ValueError("saved with another schedule")

    def _load_from_checkpoint():
        # An error raised below the method.
        json.loads("{")

    def training_step():
        raise ValueError("a bug")

    assert RESUME_STEPS == {"_load_from_checkpoint", "_load_optimizer_and_scheduler"}
    raised = {}
    for function in (_load_optimizer_and_scheduler, _load_from_checkpoint, training_step):
        try:
            function()
        except ValueError as error:
            raised[function.__name__] = raised_while_resuming(error)
    assert raised == {"_load_optimizer_and_scheduler": True, "_load_from_checkpoint": True, "training_step": False}


def test_use_peft_without_peft_is_one_line_that_names_the_extra(tmp_path, tiny_model_path):
    """In a process where `import peft` fails, as where it is not installed: refused as the flags are checked."""
    argv = ["trl-lopti", "grpo", "--model_name_or_path", tiny_model_path, "--use_cpu", "true", "--use_peft", "true"]
    script = "import runpy, sys; sys.modules['peft'] = None; sys.argv = sys.argv[1:]; "
    script += "runpy.run_module('trl_lopti', run_name='__main__')"
    result = subprocess.run(
        [sys.executable, "-c", script, *argv, "--dry_run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
    )
    assert error_line(result) == (
        "use_peft: LoRA needs PEFT, which is not installed: pip install 'trl_lopti[peft]' (use_peft from the flag "
        "--use_peft)"
    )


def test_a_model_name_neither_a_folder_nor_on_the_hub_is_one_line_naming_both(tmp_path, monkeypatch, run_cli):
    """A misspelt bare name (`tiyn`) once went to the Hub for half a minute, then ended in a traceback; with
    `HF_HUB_OFFLINE=1` (as the tests run) the Hub is not asked, and the run stops at once, before any data or model
    loads."""
    from huggingface_hub.constants import is_offline_mode

    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    argv = ["grpo", "--model_name_or_path", "tiyn", "--use_cpu", "true", "--output_dir", str(tmp_path / "out")]
    code, _, err = run_cli(argv)
    assert code == 2 and err == (
        f"trl-lopti grpo: error: model_name_or_path: 'tiyn' is no folder in {tmp_path}, nor a model in this "
        "machine's Hub cache (HF_HUB_OFFLINE=1: the Hub is not asked)\n"
    )
    assert is_offline_mode() and time.perf_counter() - start < 10
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "raised, error",
    [
        (
            "RepositoryNotFoundError",
            (
                "model_name_or_path: 'tiyn' is no folder in {cwd}, nor a model on the Hub (none of that name, or a "
                "private one: log in with hf auth login)"
            ),
        ),
        (
            "GatedRepoError",
            (
                "model_name_or_path: 'tiyn' is a gated model on the Hub: accept its terms on its page, then log in "
                "(hf auth login)"
            ),
        ),
        ("RevisionNotFoundError", "model_revision: the Hub's model 'tiyn' has no revision 'v9'"),
        (
            "LocalEntryNotFoundError",
            (
                "model_name_or_path: 'tiyn' is no folder in {cwd}, nor a model in this machine's Hub cache (the Hub "
                "cannot be reached; with HF_HUB_OFFLINE=1 it is not asked)"
            ),
        ),
        (
            "HfHubHTTPError",
            (
                "model_name_or_path: 'tiyn' is no folder in {cwd}, and the Hub could not say whether it has it (503 "
                "Service Unavailable)"
            ),
        ),
    ],
)
def test_each_answer_of_the_hub_about_a_model_name_is_one_line(tmp_path, monkeypatch, run_cli, raised, error):
    """What the Hub answers online (stood in for: the tests run offline), each as one line; with no answer (no network,
    after huggingface_hub's retries), the same."""
    import httpx
    from huggingface_hub import errors

    from trl_lopti.cli import parsing

    response = httpx.Response(404, request=httpx.Request("GET", "http://localhost/tiyn/config.json"))

    def download(repo_id, filename, revision=None):
        if raised == "LocalEntryNotFoundError":
            raise errors.LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub")
        raise getattr(errors, raised)("503 Service Unavailable\nmore", response=response)

    monkeypatch.setattr(parsing, "hf_hub_download", download)
    monkeypatch.setattr(parsing, "is_offline_mode", lambda: False)
    monkeypatch.chdir(tmp_path)
    argv = ["grpo", "--model_name_or_path", "tiyn", "--model_revision", "v9", "--use_cpu", "true"]
    code, _, err = run_cli([*argv, "--output_dir", str(tmp_path / "out")])
    assert code == 2 and err == f"trl-lopti grpo: error: {error.format(cwd=tmp_path)}\n"


def test_a_malformed_json_lines_file_names_the_line_once(tmp_path, tiny_model_path):
    """The line, counted from 1, in the one line of the error; not the datasets library's own line before it, which
    counted rows from 0."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n{"prompt": "d"}\n')
    argv = ["grpo", "--model_name_or_path", tiny_model_path, "--use_cpu", "true", "--dataset_name", str(data)]
    result = run_command(*argv, "--reward_funcs", REWARD, "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert error_line(result) == (
        f"dataset_name: cannot read the data file {data}: line 3 is not JSON: Expecting ',' delimiter (column 15)"
    )
    assert "row" not in result.stderr and "Failed to load JSON" not in result.stderr


def test_presets_dry_run_says_what_it_checked_of_each_preset(tmp_path, monkeypatch, run_cli):
    """Each preset's line says what its dry run checked: the fields its file sets, the config they built, its task
    and reward functions (imported); the last line, what every check covers. A preset that fails is named."""
    from trl_lopti.cli import presets
    from trl_lopti.cli.preset_files import PRESETS, preset_names
    from trl_lopti.cli.train import DEFAULT_REWARD_FUNCS

    code, out, err = run_cli(["presets", "--dry_run"])
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith(f"checking the presets in {PRESETS} as `trl-lopti COMMAND"), err
    names = preset_names()
    assert lines[-1] == (
        f"checked {len(names)} presets: the keys of each are fields of its command, its 3 dataclasses are built and "
        "valid (use_cpu=True), its reward functions import; no model or data loaded"
    )
    for name, line in zip(names, lines[1:-1], strict=True):
        values = yaml.safe_load((PRESETS / f"{name}.yaml").read_text())
        command = values.pop("trainer", "grpo")
        values.pop("env", None)
        config = TRAINERS[command].__name__
        rewards = ", ".join(values.get("reward_funcs") or DEFAULT_REWARD_FUNCS[values["task"]])
        what = f"ok: {len(values)} fields -> {config}; task {values['task']}; rewards {rewards}"
        assert line.split() == [name, command, *what.split()], line
    (tmp_path / "kk").mkdir()
    (tmp_path / "kk" / "bad.yaml").write_text("# a bad preset\ntask: sudoku\n")
    monkeypatch.setattr(presets, "PRESETS", tmp_path)
    code, _, err = run_cli(["presets", "--dry_run"])
    assert code == 2 and err.startswith("trl-lopti presets: error: preset kk/bad: task: must be one of"), err
