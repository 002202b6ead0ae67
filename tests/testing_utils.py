"""Helpers shared by the tests and by the scripts they run in other processes (torchrun, accelerate, vLLM).

Test files and the scripts under tests/ import shared code from here only, never from another test file, a script or
`conftest.py` (which keeps pytest's hooks, options and fixtures; tests/test_layout.py checks it). A helper that one file
uses stays in that file. Anything heavier than torch is imported inside the helper that needs it: importing this module
loads no TRL, transformers or trl_lopti (the scripts choose when they do, and conftest sets the offline environment
first).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from reference_grpo import completion_logps_and_entropies


if TYPE_CHECKING:
    from datasets import Dataset

    from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer


TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# ------------------------------------------------------------------------------------------------- float64 comparisons
# Model loading and precision for tests that compare a trained model (or gradients) with a hand-run or another run: the
# tiny model in float64 (`dtype="auto"` keeps the dtype it was saved in; TRL loads float32 otherwise) and no bf16
# autocast (TRL's default, even on CPU). Two correct implementations then agree to ~1e-12 on any CPU, so a tolerance
# of 1e-8 separates them from any real defect.
FLOAT64 = {"model_init_kwargs": {"dtype": "auto"}, "bf16": False}


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


class LogProbHeadOutput:
    """The fields of TRL's fused-LM-head output that GRPOTrainer reads."""

    def __init__(self, log_probs, entropy, aux_loss):
        self.log_probs, self.entropy, self.aux_loss = log_probs, entropy, aux_loss
        self.loss = -log_probs.sum()


def use_exact_log_prob_head(trainer, *other_models) -> None:
    """
    Makes TRL's log-prob forward (`model(..., labels=..., fused_lm_head=True)`) compute in the model's dtype, on the
    trainer's models and on `other_models` (a model a user's loss runs through TRL's forward).

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
    for model in other_models:
        exact_head(model)


# ------------------------------------------------------------------------------------- thresholds far from every value
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
        from accelerate.utils import gather_object

        from trl_lopti.core_algos import loss_token_mask
        from trl_lopti.utils import trl_completion_logps

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


# A random tiny model's probabilities cluster near 1/vocab, where no fixed eta splits a batch the same way on every
# CPU: tests that split train with the `mid_gap_trainer` fixture's class (`MidGapEta`), whose eta for each
# generation batch lies half-way in a wide gap of that batch's pi_old in place of this placeholder.
ETA_FROM_EACH_BATCH = 0.5


# ---------------------------------------------------------------------------------------------- the trainer's schedule
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

    TRL shuffles and splits the batch; the trainer then adds its split and AR's values (under their own keys) to the
    buffered micro-batches. This maps each buffered micro-batch back to the original rows, so a hand-run starts from
    what the generation produced.
    """
    return [
        {key: value[entry["row_id"]] if value.dim() else value for key, value in batch.items()}
        for entry in trainer._buffered_inputs
    ]


class PolicyPassCounter:
    """
    Counts the policy's forwards outside generation, split by grad mode, and its backward passes.

    A forward pre-hook counts every forward of the model; those inside `model.generate` (decoding) are left out, so
    the count does not depend on the arguments TRL passes to its log-prob forward in a given release.
    """

    def __init__(self, model):
        self.forwards_with_grad = self.forwards_without_grad = self.backwards = 0
        self._generating = 0
        generate = model.generate

        def counted_generate(*args, **kwargs):
            self._generating += 1
            try:
                return generate(*args, **kwargs)
            finally:
                self._generating -= 1

        model.generate = counted_generate
        model.register_forward_pre_hook(self._on_forward)
        model.get_input_embeddings().register_full_backward_hook(self._on_backward)

    def _on_forward(self, module, args):
        if self._generating:
            return
        if torch.is_grad_enabled():
            self.forwards_with_grad += 1
        else:
            self.forwards_without_grad += 1

    def _on_backward(self, module, grad_input, grad_output):
        self.backwards += 1


# ------------------------------------------------------------------------------------------------- small training runs
def length_reward(completions, **kwargs):
    """Varies across completions, so advantages are non-zero."""
    return [float(len(completion[0]["content"]) % 5) for completion in completions]


def conversational_dataset(num_prompts: int = 16) -> Dataset:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(num_prompts)]})


def small_config(output_dir, config_class=None, **overrides):
    """A 4-step run's config: `config_class` (default `LoptiGRPOConfig`) with `overrides`."""
    if config_class is None:
        from trl_lopti import LoptiGRPOConfig as config_class

    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=7,
    )
    values.update(overrides)
    return config_class(**values)


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if entry.get(key) is not None]


def assert_no_nan_in_logs(trainer):
    """No NaN in any value the trainer logged."""
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            assert not (isinstance(value, float) and math.isnan(value)), (key, entry)


# -------------------------------------------------------------------------------------------- a fixed generation batch
TEMPERATURE = 0.7
COMPLETION_LENGTH = 6
PROMPT_LENGTH = 4


def fixed_generation_batch(model_path: str, num_rows: int, seed: int, beta: float) -> dict:
    """A generation batch as `_generate_and_score_completions` returns it (without pi_old: added at generation)."""
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    vocab_size = model.config.vocab_size
    completion_mask = torch.ones(num_rows, COMPLETION_LENGTH, dtype=torch.long)
    completion_mask[0, 3:] = 0
    batch = {
        "prompt_ids": torch.randint(3, vocab_size, (num_rows, PROMPT_LENGTH), generator=generator),
        "prompt_mask": torch.ones(num_rows, PROMPT_LENGTH, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab_size, (num_rows, COMPLETION_LENGTH), generator=generator),
        "completion_mask": completion_mask,
        "advantages": torch.randn(num_rows, generator=generator),
        "num_items_in_batch": completion_mask.sum(),
        "row_id": torch.arange(num_rows),  # follows the rows through TRL's shuffle (`micro_batches_as_generated`)
    }
    with torch.no_grad():
        logps, _ = completion_logps_and_entropies(model, batch, TEMPERATURE)
        if beta != 0.0:
            batch["ref_per_token_logps"] = logps  # the reference model is the initial model
    # random tiny model: an eta (in log space) that splits the batch, far from every token's log-probability
    eta = threshold_between_values(logps[completion_mask.bool()])
    return batch, eta


# --------------------------------------------------------------------------------- one quantile cycle on a fixed batch
LEARNING_RATE = 0.5
ALPHA = 0.3
# plain SGD (no momentum, decay or clipping, constant rate): the update a hand run makes with torch.optim.SGD
PLAIN_SGD = dict(
    optim="sgd", learning_rate=LEARNING_RATE, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0
)


def completion_logps(model, batch: dict) -> torch.Tensor:
    """Log-probabilities of the sampled completion tokens at `TEMPERATURE`, in the model's precision (float64 here)."""
    return completion_logps_and_entropies(model, batch, TEMPERATURE)[0]


def quantile_generation_batch(vocab_size: int, num_rows: int, seed: int = 0) -> dict:
    """A whole generation batch (every process) as `_generate_and_score_completions` returns it, less pi_old."""
    generator = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(num_rows, COMPLETION_LENGTH, dtype=torch.long)
    lengths = torch.randint(2, COMPLETION_LENGTH + 1, (num_rows,), generator=generator)
    completion_mask[torch.arange(COMPLETION_LENGTH)[None, :] >= lengths[:, None]] = 0  # padding
    return {
        "prompt_ids": torch.randint(3, vocab_size, (num_rows, PROMPT_LENGTH), generator=generator),
        "prompt_mask": torch.ones(num_rows, PROMPT_LENGTH, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab_size, (num_rows, COMPLETION_LENGTH), generator=generator),
        "completion_mask": completion_mask,
        "advantages": torch.randn(num_rows, generator=generator, dtype=torch.float64),
        "row_id": torch.arange(num_rows),  # follows the rows through TRL's shuffle (`micro_batches_as_generated`)
    }


def fixed_generation(batch: dict):
    """A stand-in for `GRPOTrainer._generate_and_score_completions`: this process's slice of `batch`.

    Like TRL it computes pi_old at generation only when gradient_accumulation_steps is not a multiple of
    steps_per_generation * num_iterations (the rule LoptiGRPOTrainer relies on to get pi_old for the quantile).
    """

    def generate(self, inputs):
        rows = len(inputs)
        start = self.accelerator.process_index * rows
        output = {key: value[start : start + rows].clone() for key, value in batch.items()}
        output["num_items_in_batch"] = batch["completion_mask"].sum()  # every process's tokens, as TRL gathers them
        if self.args.gradient_accumulation_steps % (self.args.steps_per_generation * self.num_iterations) != 0:
            with torch.no_grad():
                output["old_per_token_logps"] = completion_logps(self.model, output)
        return output

    return generate


def quantile_config(
    output_dir: str,
    rows_per_process: int,
    gradient_accumulation_steps: int,
    steps_per_generation: int,
    quantile: float,
    **overrides,
) -> LoptiGRPOConfig:
    from trl_lopti import LoptiGRPOConfig

    values = dict(
        output_dir=output_dir,
        per_device_train_batch_size=rows_per_process // steps_per_generation,
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        num_generations=2,
        max_completion_length=COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        beta=0.0,
        advantage_reweighting_alpha=ALPHA,
        lopti_threshold=None,
        lopti_quantile=quantile,
        **PLAIN_SGD,
        bf16=False,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        shuffle_dataset=False,
        max_steps=2 * steps_per_generation // gradient_accumulation_steps,  # exactly one Lopti cycle
    )
    values.update(overrides)
    return LoptiGRPOConfig(**values)


def run_one_cycle(model_path: str, config: LoptiGRPOConfig, batch: dict) -> LoptiGRPOTrainer:
    """Trains one Lopti cycle of a float64 copy of the model on `batch` (the caller installs `fixed_generation`)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trl_lopti import LoptiGRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    trainer = LoptiGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * 64}),
    )
    use_exact_log_prob_head(trainer)  # TRL's fused head is float32 whatever the model's dtype; the hand run is not
    trainer.train()
    return trainer


# ------------------------------------------------------------------------ other processes: torchrun, accelerate launch
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script_name: str, num_processes: int, *arguments: str) -> None:
    script = Path(__file__).with_name(script_name)
    environment = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(num_processes),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *arguments,
    ]
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]


TEST_SETTINGS = {
    # a float64 model (conftest's) without mixed precision: two correct runs agree to ~1e-15 (see LAUNCH_FLAGS too)
    "dtype": "auto",
    "bf16": False,
    # SGD with momentum and a large step instead of AdamW at 1e-6: the parameters move far and a wrong gradient shows
    # (AdamW's first step is lr * sign(gradient)); the momentum is optimizer state that the backends must shard
    "optim": "sgd",
    "optim_args": "momentum=0.9",
    "learning_rate": 0.05,
    # the fixed generation batch of launcher_probe; eta (`lopti_threshold`) lies half-way in a wide gap of its pi_old
    "reward_funcs": ["launcher_probe.fixed_batch_reward"],
}
LAUNCH_FLAGS = ["--num_processes", "2", "--mixed_precision", "no"]  # the shipped files say bf16


def run(command: list[str], cwd: Path, **environment) -> float:
    """Runs a command offline with the repository and tests/ importable; returns its seconds."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        **environment,
    )
    start = time.perf_counter()
    completed = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    return time.perf_counter() - start


def accelerate_launch(
    launcher_file: Path, *arguments: str, flags: tuple[str, ...] = ("--num_processes", "2"), command: str = "grpo"
):
    """`accelerate launch --config_file LAUNCHER_FILE FLAGS -m trl_lopti COMMAND ARGUMENTS --rehearse`, as a list."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(launcher_file),
        *flags,
        "--main_process_port",
        str(free_port()),
        "-m",
        "trl_lopti",
        command,
        *arguments,
        "--rehearse",
    ]


def load_parameters(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {name: tensor.double() for name, tensor in load_file(folder / "model.safetensors").items()}


def report_row(row: dict) -> None:
    print(json.dumps(row))  # noqa: T201 - the launcher table's row, for the record (pytest -s)
    if os.environ.get("TRL_LOPTI_LAUNCHER_REPORT"):
        with open(os.environ["TRL_LOPTI_LAUNCHER_REPORT"], "a") as report:
            report.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------------------------------------- vLLM runs
PROMPTS = [f"Count to {number}:" for number in range(16)]
"""The prompts of the vLLM tests' runs (tests/test_vllm.py and tests/vllm_colocate_script.py)."""


def no_transformers_generate(*args, **kwargs):
    """Put in place of transformers' `generate` in a run whose every rollout must come from vLLM."""
    raise AssertionError("transformers' generate was called: a rollout did not come from vLLM")


# ----------------------------------------------------------------------------------------------- the benchmark scripts
def load_benchmark_script(name: str):
    """Imports `benchmarks/<name>.py` (not a package) as the module `name`."""
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- a loss with a side forward
def anchor_metric_trainer(anchor: torch.nn.Module, anchor_rows: int | None = None) -> type:
    """
    A Lopti trainer whose base is a user's `GRPOTrainer` subclass with a side forward: its `_compute_loss` first reads
    a frozen `anchor` model's log-probabilities through `self._get_per_token_logps_and_entropies` (the anchor given a
    log-prob head, as TRL gives its models: `add_fused_lm_head` or `use_exact_log_prob_head`), without gradient,
    for a metric it then ignores (over the first `anchor_rows` rows of the batch; all where `None`), and then returns
    TRL's loss. The documented order: `class LoptiAnchorMetricTrainer(LoptiGRPOTrainer, AnchorMetricTrainer)`.
    """
    from trl import GRPOTrainer

    from trl_lopti import LoptiGRPOTrainer

    class AnchorMetricTrainer(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            rows = inputs["completion_ids"].size(0) if anchor_rows is None else anchor_rows
            input_ids = torch.cat([inputs["prompt_ids"][:rows], inputs["completion_ids"][:rows]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"][:rows], inputs["completion_mask"][:rows]], dim=1)
            with torch.no_grad():
                logits_to_keep = inputs["completion_ids"].size(1)
                self._get_per_token_logps_and_entropies(anchor, input_ids, attention_mask, logits_to_keep)
            return super()._compute_loss(model, inputs)

    class LoptiAnchorMetricTrainer(LoptiGRPOTrainer, AnchorMetricTrainer):
        pass

    return LoptiAnchorMetricTrainer


def perturbed_model(model_path: str, scale: float = 0.05, **kwargs):
    """The model at `model_path` with N(0, `scale`) noise added to every parameter: a model unlike the policy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter += scale * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
    return model.requires_grad_(False)


# ---------------------------------------------------------------------------------------------- TRL, broken on purpose
# Each mutation makes TRL's trainer class behave as a plausible future release that breaks one fact of
# `trl_lopti.trl_contract.TRL_FACTS` would (monkeypatch undoes it). tests/test_fact_checks.py trains with each one and expects
# the trainer's runtime check of that fact to stop it; tests/test_layout.py checks that every fact has one.
def _generates_at_every_pass(monkeypatch, trl_class):  # S1: generates by the user's num_iterations, not its own
    prepare = trl_class._prepare_inputs

    def regenerating(self, batch):
        if self.model.training and self._step % (self.args.steps_per_generation * self.args.num_iterations) == 0:
            self._buffered_inputs = None
        return prepare(self, batch)

    monkeypatch.setattr(trl_class, "_prepare_inputs", regenerating)


def _repeats_once_per_pass(monkeypatch, trl_class):  # the sampler repeats by args.num_iterations
    from trl_lopti.utils import temporarily_set

    sampler = trl_class._get_train_sampler

    def sampler_by_the_arguments(self, *args, **kwargs):
        with temporarily_set(self, num_iterations=self.args.num_iterations):
            return sampler(self, *args, **kwargs)

    monkeypatch.setattr(trl_class, "_get_train_sampler", sampler_by_the_arguments)


def _loss_not_through_the_hook(monkeypatch, trl_class):  # S2: a fused loss; the hooked forward feeds metrics only
    loss = trl_class._compute_loss

    def fused(self, model, inputs):
        with torch.no_grad():
            loss(self, model, inputs)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps = trl_class._get_per_token_logps_and_entropies(
            self, model, ids, attention, ids.size(1) - inputs["prompt_ids"].size(1)
        )[0]
        mask = inputs["completion_mask"]
        return -(logps * mask).sum() / mask.sum().clamp(min=1)

    monkeypatch.setattr(trl_class, "_compute_loss", fused)


def _loss_counts_padding(
    monkeypatch, trl_class
):  # S4: a loss that sums its terms over padding too (as TRL 1.9's LUSPO)
    from trl_lopti.utils import temporarily_set

    loss = trl_class._compute_loss

    def counting_padding(self, model, inputs):
        returned, forward = [], self._get_per_token_logps_and_entropies

        def recorded(*args, **kwargs):
            returned.append(forward(*args, **kwargs))
            return returned[-1]

        with temporarily_set(self, _get_per_token_logps_and_entropies=recorded):
            value = loss(self, model, inputs)
        return value - 0.1 * (returned[0][0] * (1 - inputs["completion_mask"])).sum()

    monkeypatch.setattr(trl_class, "_compute_loss", counting_padding)


def _state_loaded_after_the_hook(monkeypatch, trl_class):  # S3: the trainer state is not loaded yet in the hook
    from transformers import TrainerState

    load = TrainerState.load_from_json.__func__

    def not_yet_loaded(cls, path):  # the state at the hook: its step not yet restored
        state = load(cls, path)
        state.global_step = 0
        return state

    monkeypatch.setattr(TrainerState, "load_from_json", classmethod(not_yet_loaded))


def _hook_not_called(monkeypatch, trl_class):  # S3: the training loop restores the optimizer through another hook
    import functools

    import transformers

    loop = transformers.Trainer._inner_training_loop

    def loop_with_the_base_hook(self, *args, **kwargs):
        self._load_optimizer_and_scheduler = functools.partial(
            transformers.Trainer._load_optimizer_and_scheduler, self
        )
        return loop(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "_inner_training_loop", loop_with_the_base_hook)


def _advantages_per_sequence(monkeypatch, trl_class):  # G1: token-level advantages averaged over each sequence
    loss = trl_class._compute_loss

    def per_sequence(self, model, inputs):
        advantages = inputs["advantages"]
        if advantages.dim() == 2:
            inputs = dict(inputs)
            mask = inputs["completion_mask"]
            inputs["advantages"] = (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
        return loss(self, model, inputs)

    monkeypatch.setattr(trl_class, "_compute_loss", per_sequence)


def _no_pi_old(monkeypatch, trl_class):  # G2: no old_per_token_logps off-policy
    generate = trl_class._generate_and_score_completions

    def without_pi_old(self, inputs):
        output = generate(self, inputs)
        output.pop("old_per_token_logps", None)
        return output

    monkeypatch.setattr(trl_class, "_generate_and_score_completions", without_pi_old)


def _rewards_elsewhere(monkeypatch, trl_class):  # G3: the rewards come from another method than _calculate_rewards
    import functools

    from trl_lopti.utils import temporarily_set

    generate = trl_class._generate_and_score_completions

    def renamed(self, inputs):
        with temporarily_set(self, _calculate_rewards=functools.partial(trl_class._calculate_rewards, self)):
            return generate(self, inputs)

    monkeypatch.setattr(trl_class, "_generate_and_score_completions", renamed)


def _old_logps_elsewhere(monkeypatch, trl_class):  # R1: old_logps no longer the first forward's masked sum
    generate = trl_class._generate_and_score_completions

    def shifted(self, inputs):
        output = generate(self, inputs)
        output["old_logps"] = output["old_logps"] + 1.0
        return output

    monkeypatch.setattr(trl_class, "_generate_and_score_completions", shifted)


def _tool_mask(monkeypatch, trl_class):  # R2: RLOO returns a tool_mask, which its loss ignores
    generate = trl_class._generate_and_score_completions

    def with_tool_mask(self, inputs):
        output = generate(self, inputs)
        output["tool_mask"] = torch.ones_like(output["completion_mask"])
        return output

    monkeypatch.setattr(trl_class, "_generate_and_score_completions", with_tool_mask)


TRL_MUTATIONS = {
    "generation at every pass": ("S1", _generates_at_every_pass),
    "sampler repeats by the config's num_iterations": ("S1", _repeats_once_per_pass),
    "loss not through the hooked forward": ("S2", _loss_not_through_the_hook),
    "state loaded after the hook": ("S3", _state_loaded_after_the_hook),
    "hook not called on resume": ("S3", _hook_not_called),
    "a loss that counts padding": ("S4", _loss_counts_padding),
    "token-level advantages per sequence": ("G1", _advantages_per_sequence),
    "no pi_old off-policy": ("G2", _no_pi_old),
    "rewards from another method": ("G3", _rewards_elsewhere),
    "old_logps not the first forward": ("R1", _old_logps_elsewhere),
    "a tool_mask": ("R2", _tool_mask),
}
"""Mutation name -> (the code of the fact of `trl_lopti.trl_contract.TRL_FACTS` it breaks, `mutation(monkeypatch,
trl_class)`)."""


# What leaves every update the method's (the logs, the completions table): a TRL that changes it never stops a run,
# which warns or carries on (tests/test_fact_checks.py).
def _metrics_kept(monkeypatch, trl_class):  # log keeps the metrics it averaged (a running mean)
    log = trl_class.log

    def keeping(self, logs, start_time=None):
        mode = "train" if self.model.training else "eval"
        kept = {key: list(values) for key, values in self._metrics[mode].items()}
        log(self, logs, start_time)
        self._metrics[mode].update(kept)

    monkeypatch.setattr(trl_class, "log", keeping)


def _advantages_unlogged(monkeypatch, trl_class):  # the advantages logged elsewhere than self._logs
    generate = trl_class._generate_and_score_completions

    def unlogged(self, inputs):
        output = generate(self, inputs)
        for _ in range(len(output["advantages"]) * self.accelerator.num_processes):
            self._logs["advantages"].pop()
        return output

    monkeypatch.setattr(trl_class, "_generate_and_score_completions", unlogged)


NO_WRONG_UPDATE_MUTATIONS = {
    "metrics kept after log": _metrics_kept,
    "advantages not logged": _advantages_unlogged,
}
"""Mutation name -> `mutation(monkeypatch, trl_class)`, of what leaves every update the method's."""
