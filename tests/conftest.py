"""pytest's hooks, options and environment, and the shared fixtures: tiny offline models saved to temporary folders,
and the command line run in-process. Shared plain helpers live in tests/testing_utils.py (fixtures call them there).
"""

import os

import pytest


# the asserts of the shared helpers report their operands as the tests' own do (before anything imports the module)
pytest.register_assert_rewrite("testing_utils")


def pytest_addoption(parser):
    parser.addoption(
        "--reverse-order",
        action="store_true",
        default=False,
        help="run the collected tests in reverse order (CI's check that no test depends on another's state)",
    )
    parser.addoption(
        "--order-sample",
        type=int,
        default=1,
        help="run every Nth collected test only (after --reverse-order): CI's order check on a sample",
    )
    parser.addoption(
        "--vllm",
        action="store_true",
        default=False,
        help="run tests/test_vllm.py alone: vLLM for real, which needs the CPU vLLM environment (make vllm-cpu)",
    )


def pytest_ignore_collect(collection_path, config):
    """tests/test_vllm.py runs with `--vllm` and everything else without it."""
    if collection_path.name.startswith("test_") and collection_path.suffix == ".py":
        return (collection_path.name == "test_vllm.py") != config.getoption("--vllm") or None
    return None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse-order"):
        items.reverse()
    every = config.getoption("--order-sample")
    if every > 1:
        # Every Nth test of the (reversed) order, from the second on, so that each kept test runs after another one
        # than in the plain order.
        kept = items[1::every]
        kept_ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
        items[:] = kept


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
def tiny_float64_model_path(tiny_model_path, tmp_path_factory) -> str:
    """`tiny_model_path` (same weights and tokenizer) saved in float64; load it with `**FLOAT64` (testing_utils)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2-float64")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).to(torch.float64)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return str(path)


@pytest.fixture
def float64_norms(monkeypatch):
    """`testing_utils.patch_float64_norms` for the duration of one test."""
    from testing_utils import patch_float64_norms

    patch_float64_norms(monkeypatch)


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


@pytest.fixture
def mid_gap_trainer():
    """`testing_utils.mid_gap_eta_trainer()` for one test: train with it; its `etas` are the ones chosen, one per
    generation batch."""
    from testing_utils import mid_gap_eta_trainer

    return mid_gap_eta_trainer()
