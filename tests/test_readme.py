"""The READMEs' and the documentation pages' commands name files that exist (a user copies them as they are), and
`.ci/run` runs every command of the README (the site's home page) as the README writes it."""

import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
READMES = ["README.md", "configs/README.md", "benchmarks/README.md"]
PAGES = sorted(str(page.relative_to(ROOT)) for page in (ROOT / "docs").rglob("*.md"))  # the documentation site's
DOCS = READMES + PAGES
PATH_PATTERN = re.compile(
    r"(?<![\w/.-])((?:configs|notebooks|benchmarks|tests|trl_lopti|docs)/[\w./-]*\w\.(?:ya?ml|ipynb|py|sh|md|json|png))"
)


def named_paths(doc: str) -> list[str]:
    return sorted(set(PATH_PATTERN.findall((ROOT / doc).read_text())))


@pytest.mark.parametrize("doc", [doc for doc in DOCS if (ROOT / doc).exists()])
def test_every_path_a_readme_names_exists(doc):
    paths = named_paths(doc)
    assert paths or doc in PAGES, f"{doc} names no file: the pattern is broken"  # a page may name none
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_the_pattern_finds_the_paths_in_commands():
    text = "accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m trl_lopti grpo --config x.yaml"
    assert PATH_PATTERN.findall(text) == ["configs/accelerate/multi_gpu.yaml"]
    assert PATH_PATTERN.findall("see [`notebooks/a_b.ipynb`](notebooks/a_b.ipynb).") == ["notebooks/a_b.ipynb"] * 2
    assert PATH_PATTERN.findall("[Benchmarks](docs/benchmarks.md)") == ["docs/benchmarks.md"]


def test_the_readme_links_the_documentation_pages_and_the_site_has_them():
    """The README's topic sections link the site's pages (which the test above finds), and it names the site's home."""
    linked = {path for path in named_paths("README.md") if path.startswith("docs/")}
    assert {"docs/method.md", "docs/benchmarks.md", "docs/cpu.md"} <= linked
    assert (ROOT / "docs" / "index.md").read_text().strip() == "<!-- README.md -->"  # the home page is the README


NOT_RUN_BY_CI = {  # commands of the README that .ci/run does not run as written, and why
    'pip install -e ".[docs]" && mkdocs serve': "it serves until stopped; .ci/run builds the same site, --strict",
}


def readme_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks of a README, in order, without their comments."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def runs_as_written(command: str, script: str) -> bool:
    """Whether a line of `script` runs `command` as written: alone, or with only its output redirected or piped, or a
    failure handled (`make demo 2>&1 | tee LOG`, `... || { ...; exit 1; }`)."""
    lines = [line.strip() for line in script.splitlines()]
    return any(line == command or re.match(re.escape(command) + r" (\||>|2>)", line) for line in lines)


def test_ci_runs_every_command_of_the_readme_as_written():
    """The README's first command (`make demo`) and the test command lead; .ci/run runs each command, the first-run ones
    of the command-line section included, as written (a changed command here or there fails)."""
    commands = readme_commands((ROOT / "README.md").read_text())
    assert commands[:2] == ["make demo", 'pip install "torch==2.13.0" -e ".[test]" && python -m pytest -q']
    assert {"trl-lopti --help", "make presets"} <= set(commands) and set(NOT_RUN_BY_CI) <= set(commands)
    assert any("--dry_run" in command for command in commands) and any("--rehearse" in command for command in commands)
    script = (ROOT / ".ci" / "run").read_text()
    missing = [
        command for command in commands if command not in NOT_RUN_BY_CI and not runs_as_written(command, script)
    ]
    assert missing == [], f".ci/run does not run these README commands as written: {missing}"


def shell_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks of a page, in order, their continued lines joined, without comments."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    joined = [line for block in blocks for line in re.sub(r"\\\n\s*", "", block).splitlines()]
    return [line.split(" #")[0].strip() for line in joined if line.strip() and not line.lstrip().startswith("#")]


def test_the_as_written_check_takes_redirections_only():
    script = (
        'make demo 2>&1 | tee "$workdir/demo.log"\n    trl-lopti --help > /dev/null\nmake presets PYTHON=python3\n'
    )
    assert runs_as_written("make demo", script) and runs_as_written("trl-lopti --help", script)
    assert not runs_as_written("make presets", script) and not runs_as_written("make", script)
    text = "```bash\nmake demo   # main job\n# a comment\n\npip install -e .\n```\n```python\nimport x\n```\n"
    assert readme_commands(text) == ["make demo", "pip install -e ."]


def python_example(doc: str) -> str:
    """The Python example a page gives a user: the README's usage snippet (which the trainer pages include), the
    quickstart's first Python block."""
    text = (ROOT / doc).read_text()
    if doc == "README.md":
        return re.search(r"--8<-- \[start:usage\] -->\n```python\n(.*?)```", text, re.DOTALL)[1]
    return re.search(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)[1]


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "steps"), [("README.md", 24), ("docs/quickstart.md", 20)])
def test_the_python_examples_train_on_a_cpu_as_written_with_their_one_line_for_a_machine_without_a_gpu(
    doc, steps, tmp_path, tiny_model_path, monkeypatch
):
    """Each example runs as a user copies it, every name it uses defined in it, its model swapped for a tiny local one
    (tests fetch nothing from a hub): TRL's default bf16 stops it on a CPU, and its commented `use_cpu=True` line,
    uncommented, makes it train, Lopti's metrics logged (the README's: 4 prompts x 8 completions, 3 epochs, two passes
    each; the quickstart's: `max_steps=20`, then its model saved)."""
    import torch

    if torch.accelerator.is_available():
        pytest.skip("what a machine without an accelerator does")
    snippet = python_example(doc)
    assert snippet.count('"Qwen/Qwen2.5-0.5B-Instruct"') == 1 and snippet.count("# use_cpu=True,") == 1
    snippet = snippet.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(tiny_model_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "as_written.py").write_text(snippet)
    (tmp_path / "on_a_cpu.py").write_text(snippet.replace("# use_cpu=True,", "use_cpu=True,"))
    with pytest.raises(ValueError, match="use_cpu"):
        runpy.run_path(str(tmp_path / "as_written.py"))
    trainer = runpy.run_path(str(tmp_path / "on_a_cpu.py"))["trainer"]
    assert trainer.state.global_step == steps
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"lopti/low_token_share", "lopti/ar_weight_mean", "lopti/loss_low_pass", "lopti/loss_high_pass"} <= logged
    saved = {path.name for path in (tmp_path / "qwen-lopti").iterdir()}
    if doc == "docs/quickstart.md":
        assert {"config.json", "model.safetensors"} <= saved, saved


def test_the_quickstarts_command_line_runs_on_the_data_and_reward_it_writes(tmp_path):
    """The quickstart's `trl-lopti grpo` commands, as written (the one without `--dry_run` checked with it: it would
    train a 0.5B model), in a folder holding its `prompts.jsonl` and a `my_rewards.py` of its script's `import re` and
    `exact_answer`: accepted, the reward imported from that folder and the data file found (a dry run checks both)."""
    text = (ROOT / "docs/quickstart.md").read_text()
    rows = re.search(r"^```json\n(.*?)^```", text, re.MULTILINE | re.DOTALL)[1]
    assert all(set(json.loads(row)) == {"prompt", "answer"} for row in rows.splitlines())
    (tmp_path / "prompts.jsonl").write_text(rows)
    example = python_example("docs/quickstart.md")
    reward = re.search(r"^def exact_answer\(.*?(?=^\S)", example, re.MULTILINE | re.DOTALL)[0]
    (tmp_path / "my_rewards.py").write_text(f"import re\n\n\n{reward}")
    commands = [command for command in shell_commands(text) if command.startswith("trl-lopti grpo")]
    assert len(commands) == 2 and commands[0] == f"{commands[1]} --dry_run", commands
    arguments = shlex.split(commands[0])[1:]
    environment = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    completed = subprocess.run(
        [sys.executable, "-m", "trl_lopti", *arguments],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    printed = json.loads(completed.stdout[completed.stdout.index("{") :])
    assert printed["reward_funcs"] == ["my_rewards.exact_answer"]
    assert printed["flags"]["model_name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
