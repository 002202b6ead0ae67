"""The Colab notebook: committed without outputs, and runs end to end on CPU with a tiny local model in place of Qwen."""

import json
import math
from pathlib import Path

import nbclient  # the test extra installs both: missing, they fail here, not skip
import nbformat
import pytest


NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "lopti_knights_knaves_colab.ipynb"
COLAB_URL = (
    "https://colab.research.google.com/github/trl-lopti/trl_lopti/blob/main/notebooks/lopti_knights_knaves_colab.ipynb"
)
KERNEL_NAME = "python3"


def read_notebook():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    return notebook


def parameters_cell_index(notebook) -> int:
    indices = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(indices) == 1, "exactly one cell must be tagged `parameters`"
    return indices[0]


def test_committed_notebook_has_no_outputs():
    for cell in read_notebook().cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


def test_notebook_has_badge_parameters_and_install_cell():
    notebook = read_notebook()
    first = notebook.cells[0]
    assert first.cell_type == "markdown"
    assert f"]({COLAB_URL})" in first.source and "colab-badge.svg" in first.source

    parameters = notebook.cells[parameters_cell_index(notebook)]
    namespace = {}
    exec(parameters.source, namespace)  # noqa: S102 - the notebook's own parameters cell: plain assignments
    assert namespace["MODEL_NAME"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert namespace["INSTALL"] is True and namespace["USE_CPU"] is False
    assert namespace["PRECISION"] == "fp16", "a T4 has no bf16"
    assert namespace["AR_ALPHA"] == 0.3 and namespace["LOPTI_ETA"] == 0.5
    sources = "\n".join(cell.source for cell in notebook.cells)
    assert "Qwen2.5-1.5B-Instruct" in sources
    install = [cell for cell in notebook.cells if cell.cell_type == "code" and 'pip", "install' in cell.source]
    assert len(install) == 1 and "if INSTALL:" in install[0].source
    # The install source is one named parameter, used by the install cell and nowhere else.
    assert namespace["TRL_LOPTI_PIP_SOURCE"].startswith("trl_lopti[peft]")
    assert "TRL_LOPTI_PIP_SOURCE]" in install[0].source and "git+" not in install[0].source


@pytest.fixture(scope="module")
def python_kernel():
    """A `python3` Jupyter kernel for nbclient, installed for the user when none is registered."""
    from jupyter_client.kernelspec import KernelSpecManager

    if KERNEL_NAME not in KernelSpecManager().find_kernel_specs():
        from ipykernel.kernelspec import install

        install(user=True, kernel_name=KERNEL_NAME)
    return KERNEL_NAME


@pytest.mark.slow
def test_notebook_runs_end_to_end_with_a_tiny_model(tiny_model_path, tmp_path, python_kernel, monkeypatch):
    # The kernel inherits this environment: no hub, no W&B, no GPU.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny matrices: threads only add overhead

    output_dir = tmp_path / "outputs"
    overrides = {
        "MODEL_NAME": tiny_model_path,
        "INSTALL": False,
        "USE_CPU": True,
        "PRECISION": "fp32",
        "NUM_TRAIN_PROMPTS": 4,
        "NUM_EVAL_PROMPTS": 2,
        "MAX_STEPS": 2,
        "PER_DEVICE_TRAIN_BATCH_SIZE": 4,
        "GRADIENT_ACCUMULATION_STEPS": 1,
        "NUM_GENERATIONS": 4,
        "MAX_COMPLETION_LENGTH": 8,
        "EVAL_BATCH_SIZE": 2,
        "EVAL_MAX_NEW_TOKENS": 8,
        # A random tiny model gives its tokens p ~ 1/320: this threshold splits them, so both Lopti passes train.
        "LOPTI_ETA": 0.003,
        "OUTPUT_DIR": str(output_dir),
    }
    notebook = read_notebook()
    index = parameters_cell_index(notebook)
    injected = nbformat.v4.new_code_cell(
        "\n".join(f"{name} = {value!r}" for name, value in overrides.items()), id="injected-parameters"
    )
    notebook.cells.insert(index + 1, injected)

    client = nbclient.NotebookClient(
        notebook,
        kernel_name=python_kernel,
        timeout=300,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the failing cell's traceback, if any cell fails

    assert all(cell.execution_count is not None for cell in notebook.cells if cell.cell_type == "code")
    for name in ("reward_curves.png", "lopti_metrics.png"):
        image = output_dir / name
        assert image.read_bytes().startswith(b"\x89PNG"), name
    assert any(
        "image/png" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", [])
    ), "the plots are displayed"

    results = json.loads((output_dir / "results.json").read_text())
    assert results["model_name"] == tiny_model_path
    # The prompts pre-fill "<think>", as the markdown says: text ending in the open assistant turn.
    assert isinstance(results["prompt_example"], str) and results["prompt_example"].endswith("<think>")
    assert set(results["runs"]) == {"GRPO", "AR + Lopti"}
    grpo, lopti = results["runs"]["GRPO"], results["runs"]["AR + Lopti"]
    assert (grpo["alpha"], grpo["eta"]) == (0.0, None)
    assert (lopti["alpha"], lopti["eta"]) == (0.3, 0.003)
    # equal rollouts: Lopti takes two optimizer steps per generation batch
    assert grpo["global_step"] == 2 and lopti["global_step"] == 4

    def per_batch(run, key):
        return [entry[key] for entry in run["log_history"] if "reward" in entry and key in entry]

    for run in (grpo, lopti):
        for key in ("reward", "knights_knaves/format", "knights_knaves/answer", "knights_knaves/accuracy"):
            values = per_batch(run, key)
            assert len(values) == 2 and all(math.isfinite(value) for value in values), (key, values)
        for evaluation in (results["eval_before"], run["eval_after"]):
            assert 0.0 <= evaluation["accuracy"] <= 1.0 and 0.0 <= evaluation["format"] <= 1.0
            assert -3.0 <= evaluation["reward"] <= 3.0
        assert (output_dir / ("grpo" if run is grpo else "ar_lopti") / "adapter_config.json").is_file()

    def logged(run, key):
        return [entry[key] for entry in run["log_history"] if key in entry]

    assert not logged(grpo, "lopti/loss_low_pass") and not logged(grpo, "lopti/loss_high_pass")
    assert len(logged(lopti, "lopti/loss_low_pass")) == 2 and len(logged(lopti, "lopti/loss_high_pass")) == 2
    assert all(0.7 <= weight <= 1.0 for weight in logged(lopti, "lopti/ar_weight_mean"))
    # both runs start from the same seed, model and puzzles: their first rollouts are identical
    assert per_batch(grpo, "reward")[0] == per_batch(lopti, "reward")[0]
