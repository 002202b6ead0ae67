"""Shared test fixtures: tiny offline models saved to temporary folders, and the command line run in-process."""

import os

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A tiny random Qwen2 model and tokenizer saved to a folder (TRL builds its reference model from the path)."""
    from trl_lopti.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """The same tiny model as a Llama (the architecture of SmolLM2 and of GGUF files)."""
    from trl_lopti.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), architecture="llama")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    """The tokenizer of `tiny_model_path`, loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def run_cli(capsys):
    """Runs `trl-lopti ARGV...` in-process: `run_cli([...]) -> (exit code, stdout, stderr)`."""
    from trl_lopti.cli.main import main

    def run(argv):
        code = main(argv)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture
def single_thread():
    """Tiny models run ~10x faster on one thread than on two contended ones."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Rule for every test (it keeps the suite green on any machine): never place a threshold, quantile or median exactly
# on a value the code under test recomputes. Two forward implementations (or log space vs probability space) round
# the same token to either side of it on different CPUs. Put thresholds half-way between two values that are far
# apart, as `threshold_between_values` does.


def threshold_between_values(values, min_relative_gap: float = 1e-3) -> float:
    """
    A threshold that splits `values` about in half and lies far from every one of them.

    Takes the widest gap between neighbouring sorted values in the middle half and returns its midpoint; fails if that
    gap is narrower than `min_relative_gap` of the midpoint (then no robust split exists). The default, 1e-3, is
    about a hundred times the largest difference two float32 forward implementations show on one value.
    """
    import torch

    ordered = torch.sort(torch.as_tensor(values, dtype=torch.float64).flatten()).values
    n = ordered.numel()
    lower, upper = n // 4, max(n // 4 + 1, (3 * n) // 4)
    gaps = ordered[lower + 1 : upper + 1] - ordered[lower:upper]
    widest = int(torch.argmax(gaps))
    low_value, high_value = float(ordered[lower + widest]), float(ordered[lower + widest + 1])
    midpoint = (low_value + high_value) / 2
    assert high_value - low_value >= min_relative_gap * abs(midpoint), "no robust threshold between these values"
    return midpoint


def load_benchmark_script(name: str):
    """Imports `benchmarks/<name>.py` (not a package) as the module `name`."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module
