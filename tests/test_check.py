"""`trl-lopti check` and the version policy: the contract passes on this stack, a TRL broken on purpose fails it with
the broken fact's number, the verdict is cached per stack, and the trainers' gate of an untested release."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from testing_utils import TRL_MUTATIONS, conversational_dataset, free_port, length_reward, small_config, torchrun
from trl import GRPOTrainer, RLOOTrainer

import trl_lopti.trl_contract as contract
from trl_lopti import LoptiGRPOTrainer
from trl_lopti.check import CHECKS, run_checks


TRL_CLASSES = {"grpo": GRPOTrainer, "rloo": RLOOTrainer}


def test_the_command_passes_on_this_stack_and_caches_its_verdict(tmp_path):
    """`trl-lopti check` as a user runs it: one line per check with its facts and verdict, a summary, exit code 0, the
    verdict cached under HF_HOME for this TRL, transformers and trl_lopti."""
    environment = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    completed = subprocess.run(
        [sys.executable, "-m", "trl_lopti", "check"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    checks = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    print("\n".join(lines))  # noqa: T201 - the output, for the record (pytest -s)
    assert len(checks) == 2 * len(CHECKS) and all(line.startswith("PASS") for line in checks)
    assert "grpo off" in checks[0] and " S1 S2 S3 S5 S6 G2 " in checks[0] and "rloo ar" in checks[-2]
    assert lines[-1].startswith(f"passed: {len(checks)} of {len(checks)} checks in ")
    verdict_path = tmp_path / "hf" / "trl_lopti" / "contract"
    [verdict_file] = verdict_path.glob(f"trl-{contract.TRL_VERSION}_transformers-*_trl_lopti-*.json")
    verdict = json.loads(verdict_file.read_text())
    assert verdict["passed"] and verdict["broken_facts"] == [] and verdict["device"] == "cpu"


def mutations() -> list[tuple[str, str]]:
    """(trainer, mutation): every mutation, on GRPO (S, G) or RLOO (R)."""
    return [("rloo" if fact.startswith("R") else "grpo", name) for name, (fact, _) in TRL_MUTATIONS.items()]


@pytest.mark.parametrize("trainer, mutation", mutations())
def test_a_broken_trl_fact_fails_the_check_with_its_number(monkeypatch, trainer, mutation, single_thread):
    fact, mutate = TRL_MUTATIONS[mutation]
    mutate(monkeypatch, TRL_CLASSES[trainer])
    results = run_checks(trainers=(trainer,))
    broken = {number for result in results for number in result.broken}
    failed = [result.name for result in results if not result.passed]
    assert fact in broken, (mutation, failed, [result.detail for result in results if not result.passed])


def test_the_check_runs_bf16_autocast_as_on_a_gpu(single_thread):
    """CUDA's bf16 autocast arithmetic, reproduced on the CPU: the relations hold to the bf16 tolerance."""
    results = run_checks(precision="bf16")
    assert all(result.passed for result in results), [r.line() for r in results if not r.passed]


def test_the_checks_batch_gives_the_kl_term_a_gradient(tmp_path, single_thread):
    """The isolation relation with a KL term proves something only where that term has a gradient: the reference
    log-probabilities of the check's batch differ from the policy's (equal, the KL gradient would be exactly zero)."""
    from trl_lopti.check import Contract, classes, generation_batch_off_policy, quiet

    with contract.verifying_contract(), quiet():
        contract = Contract(tmp_path, "cpu", "fp64")
        _, trl_trainer, config, trainer_class = classes("grpo")
        generator = contract.trainer(trainer_class, config(**contract.fields("batch", beta=0.04)))
        batch, _ = generation_batch_off_policy(generator)
        args = config(**contract.fields("kl", beta=0.04, lopti_threshold=None))
        trainer = contract.trainer(trainer_class, args)
        with_kl, without = (contract.gradients(trainer, trl_trainer, batch, args, kl=kl) for kl in (True, False))
    assert float((with_kl - without).abs().max()) > 1e-4  # 2.0e-3 measured


# ---------------------------------------------------------------------------------------------------- the gate
@pytest.fixture
def untested(monkeypatch, tmp_path):
    """The installed TRL as if it were an untested release, with an empty Hugging Face cache."""
    monkeypatch.setattr(contract, "TESTED_TRL_RELEASES", ("0.0.0",))  # not the installed release
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for variable in ("GROUP_RANK", "ACCELERATE_TEST_MARKER", "TORCHELASTIC_TEST_MARKER", "NOT_A_LAUNCHER_RANK"):
        monkeypatch.setenv(variable, "0")
    checks = []

    def run_check(command, env, check):  # what the gate runs, recorded; it writes a verdict
        checks.append(command)
        verdict = {"passed": True, "broken_facts": [], "failed": []}
        contract.verdict_path().parent.mkdir(parents=True, exist_ok=True)
        contract.verdict_path().write_text(json.dumps(verdict))
        launcher = {"GROUP_RANK", "ACCELERATE_TEST_MARKER", "TORCHELASTIC_TEST_MARKER"}  # set by the fixture
        assert not launcher & set(env) and env["NOT_A_LAUNCHER_RANK"] == "0", sorted(env)
        assert env["HF_HOME"] == os.environ["HF_HOME"]
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(contract.subprocess, "run", run_check)
    return checks


def build(tmp_path):
    config = small_config(tmp_path / "out")
    return LoptiGRPOTrainer(
        model=str(tmp_path / "model"), reward_funcs=length_reward, args=config, train_dataset=conversational_dataset()
    )


def test_an_untested_release_runs_the_check_once_then_trains(untested, tiny_model_path, tmp_path):
    import shutil

    shutil.copytree(tiny_model_path, tmp_path / "model")
    build(tmp_path)
    assert untested == [[sys.executable, "-m", "trl_lopti", "check"]]
    build(tmp_path)  # the cached verdict: no second check
    assert len(untested) == 1


def test_a_failed_verdict_refuses_to_train_naming_the_broken_facts(untested, tiny_model_path, tmp_path):
    import shutil

    shutil.copytree(tiny_model_path, tmp_path / "model")
    contract.verdict_path().parent.mkdir(parents=True)
    failed = "FAIL  S3 S6 G1             grpo isolation: grpo luspo token 0.04: the whole loss's padding tokens"
    contract.verdict_path().write_text(json.dumps({"passed": False, "broken_facts": ["S6"], "failed": [failed]}))
    with pytest.raises(RuntimeError, match=r"failed trl_lopti's contract on this machine .* broken facts S6") as error:
        build(tmp_path)
    assert "padding tokens" in str(error.value) and "pip install 'trl==" in str(error.value)
    assert untested == [], "a cached verdict is not checked again"


def test_the_verdict_is_cached_per_trl_transformers_and_trl_lopti_release(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    versions = contract.stack_versions()
    path = contract.verdict_path()
    assert path.parent == tmp_path / "trl_lopti" / "contract"
    for package in ("trl", "transformers", "trl_lopti"):
        other = {**versions, package: "9.9.9"}
        monkeypatch.setattr(contract, "stack_versions", lambda other=other: other)
        assert contract.verdict_path() != path, f"a new {package} release checks again"
    monkeypatch.setattr(contract, "stack_versions", lambda: {**versions, "torch": "9.9.9"})
    assert contract.verdict_path() == path  # recorded in the verdict, not part of its key
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert contract.verdict_path().is_relative_to(tmp_path / "xdg" / "huggingface")


def test_an_untested_release_imports_with_one_warning_naming_it(monkeypatch):
    monkeypatch.setattr(contract, "version", lambda package: "1.99.0")
    with pytest.warns(UserWarning, match=r"not with the installed TRL 1\.99\.0: .*trl-lopti check") as caught:
        assert contract.check_trl_version() == "1.99.0"
    assert len(caught) == 1
    monkeypatch.setattr(contract, "version", lambda package: contract.TESTED_TRL_RELEASES[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tested release: silent
        contract.check_trl_version()


@pytest.mark.slow
def test_the_first_run_of_an_untested_release_under_two_processes_checks_once(tiny_model_path, tmp_path):
    """torchrun, 2 gloo processes, an empty cache: the first process runs the real check in a process of its own while
    the other waits, then both build their trainer and train."""
    torchrun("gate_script.py", 2, tiny_model_path, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [report["trained_steps"] for report in reports] == [2, 2]
    assert sum(report["ran_check"] for report in reports) == 1
    verdict = json.loads(next((tmp_path / "hf" / "trl_lopti" / "contract").glob("*.json")).read_text())
    assert verdict["passed"]


def test_machines_whose_caches_differ_meet_at_the_gate(tiny_model_path, tmp_path):
    """torchrun's two nodes (a process each, on this machine), each with a cache of its own: the first holds a passing
    verdict, the second none. The second runs the check while the first waits for it at the gate, then both train (a
    process that skipped the gate's barrier would leave the others waiting there for ever)."""
    port, processes = str(free_port()), []
    environment = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node)]
        command += ["--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port]
        command += [str(Path(__file__).with_name("gate_script.py")), tiny_model_path, str(tmp_path), "two_machines"]
        processes.append(subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [process.communicate(timeout=300)[0].decode()[-3000:] for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert [process.returncode for process in processes] == [0, 0], outputs
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(report["trained_steps"], report["ran_check"]) for report in reports] == [(2, 0), (2, 1)]
    verdict = json.loads(next((tmp_path / "hf1" / "trl_lopti" / "contract").glob("*.json")).read_text())
    assert verdict["passed"]
