"""`trl-lopti check` and the gate of an untested TRL release: the contract passes on this stack; a TRL broken on purpose
fails it with the broken fact's number; an error that breaks no fact is inconclusive and never cached; a verdict is kept
per trainer and stack and never used for another; an unwritable cache and `TRL_LOPTI_SKIP_CHECK=1` never stop a run."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from testing_utils import TRL_MUTATIONS, conversational_dataset, free_port, length_reward, small_config, torchrun
from trl import GRPOTrainer, RLOOTrainer

import trl_lopti.trl_contract as contract
from trl_lopti import LoptiGRPOTrainer, LoptiRLOOConfig, LoptiRLOOTrainer
from trl_lopti.check import CHECK_FACTS, main, run_checks


TRL_CLASSES = {"grpo": GRPOTrainer, "rloo": RLOOTrainer}


def test_the_command_passes_on_this_stack_and_caches_a_verdict_per_trainer(tmp_path):
    """`trl-lopti check` as a user runs it: one line per check with its facts and verdict, a line per trainer, a summary,
    exit code 0, and a verdict per trainer cached under HF_HOME for this stack, device and precision."""
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
    # The output, for the record (pytest -s).
    print("\n".join(lines))  # noqa: T201
    checks = [line for line in lines if line.startswith(("PASS", "FAIL", "ERROR", "SKIP"))]
    assert len(checks) == sum(map(len, CHECK_FACTS.values())) and all(line.startswith("PASS") for line in checks)
    assert "grpo off" in checks[0] and " S1 S2 S4 G2 " in checks[0] and "rloo ar" in checks[-1]
    assert lines[0].endswith("; cpu, bf16") and lines[-1].startswith(f"passed: {len(checks)} of {len(checks)} checks")
    for trainer in ("grpo", "rloo"):
        key = contract.verdict_key(trainer, "cpu", "bf16")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_HOME", str(tmp_path / "hf"))
            verdict = contract.read_verdict(key)
            assert f"{trainer}: passed ({contract.verdict_path(key)})" in lines
        assert verdict["outcome"] == "passed" and verdict["key"]["device"] == "cpu"


def mutations() -> list[tuple[str, str]]:
    """(trainer, mutation): every mutation, on GRPO (S, G) or RLOO (R)."""
    return [("rloo" if fact.startswith("R") else "grpo", name) for name, (fact, _) in TRL_MUTATIONS.items()]


@pytest.mark.parametrize("trainer, mutation", mutations())
def test_a_broken_trl_fact_fails_the_check_with_its_number(monkeypatch, trainer, mutation, single_thread):
    fact, mutate = TRL_MUTATIONS[mutation]
    mutate(monkeypatch, TRL_CLASSES[trainer])
    results = run_checks(trainers=(trainer,))[trainer]
    broken = {code for result in results for code in result.broken}
    assert fact in broken, (mutation, [result.line() for result in results if result.status != "PASS"])
    assert all(result.status in ("PASS", "FAIL", "SKIP") for result in results), "a broken fact is not an error"


def test_the_check_runs_bf16_autocast_as_on_a_gpu(single_thread):
    """CUDA's bf16 autocast arithmetic, reproduced on the CPU: the relations hold to the bf16 tolerance."""
    results = run_checks(precision="bf16")
    assert all(result.status == "PASS" for each in results.values() for result in each)


def test_the_checks_batch_gives_the_kl_term_a_gradient(tmp_path, single_thread):
    """The isolation relation with a KL term proves something only where that term has a gradient: the reference
    log-probabilities of the check's batch differ from the policy's (equal, the KL gradient would be exactly zero)."""
    from trl_lopti.check import Contract, generation_batch_off_policy, quiet
    from trl_lopti.utils import temporarily_set

    with temporarily_set(contract, _verifying_contract=True), quiet():
        check = Contract(tmp_path, "cpu", "fp64")
        generator = check.trainer(LoptiGRPOTrainer, check.config("grpo", "batch", beta=0.04))
        batch, _ = generation_batch_off_policy(generator)
        args = check.config("grpo", "kl", beta=0.04, lopti_threshold=None)
        trainer = check.trainer(LoptiGRPOTrainer, args)
        with_kl = check.gradients(trainer, GRPOTrainer, batch, args, kl=True)
        without = check.gradients(trainer, GRPOTrainer, batch, args, kl=False)
    # 2.0e-3 measured.
    assert float((with_kl - without).abs().max()) > 1e-4


def test_an_error_that_breaks_no_fact_is_inconclusive_and_not_cached(monkeypatch, tmp_path, capsys, single_thread):
    """Out of memory inside TRL's own loss: every check that trains fails as an error naming no fact, the verdict is
    inconclusive, nothing is cached, and the command says how to train anyway (exit code 3)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    def out_of_memory(self, model, inputs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", out_of_memory)
    assert main(["--trainers", "grpo", "--precision", "fp64"]) == 3
    output = capsys.readouterr().out
    assert "ERROR" in output and "OutOfMemoryError" in output and "broken facts" not in output
    assert "INCONCLUSIVE" in output and "TRL_LOPTI_SKIP_CHECK=1" in output
    assert not (tmp_path / "hf").exists(), "an inconclusive verdict is never cached"


def test_the_verdict_is_kept_per_trainer_stack_device_and_precision(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    key = contract.verdict_key("grpo", "cpu", "bf16")
    assert set(key) == {"trl", "transformers", "torch", "accelerate", "trl_lopti", "trl_lopti_source", "trainer"} | {
        "device",
        "precision",
    }
    path = contract.verdict_path(key)
    assert path.parent == tmp_path / "trl_lopti" / "contract" and path.name.startswith("grpo-")
    contract.write_verdict({"key": key, "outcome": "passed"})
    assert contract.read_verdict(key)["outcome"] == "passed"
    for name in key:
        other = dict(key, **{name: "another"})
        assert contract.verdict_path(other) != path and contract.read_verdict(other) is None, name
    # A file that holds another key (a collision of digests, or an edited file) is no verdict of this one.
    path.write_text(json.dumps({"key": dict(key, torch="another"), "outcome": "passed"}))
    assert contract.read_verdict(key) is None
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert contract.verdict_path(key).is_relative_to(tmp_path / "xdg" / "huggingface")


def test_the_source_of_an_edited_checkout_is_another_stack(monkeypatch, tmp_path):
    import shutil

    package = tmp_path / "trl_lopti"
    shutil.copytree(Path(contract.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(contract, "__file__", str(package / "trl_contract.py"))
    before = contract.verdict_key("grpo", "cpu", "bf16")["trl_lopti_source"]
    (package / "core_algos.py").write_text((package / "core_algos.py").read_text() + "\n# an edit\n")
    assert contract.verdict_key("grpo", "cpu", "bf16")["trl_lopti_source"] != before


def test_an_untested_release_imports_with_one_warning_naming_it(monkeypatch):
    monkeypatch.setattr(contract, "version", lambda package: "1.99.0")
    with pytest.warns(UserWarning, match=r"not with the installed TRL 1\.99\.0: .*trl-lopti check") as caught:
        assert contract.check_trl_version() == "1.99.0"
    assert len(caught) == 1 and "TRL_LOPTI_SKIP_CHECK=1" in str(caught[0].message)
    monkeypatch.setattr(contract, "version", lambda package: contract.TESTED_TRL_RELEASES[-1])
    # A tested release: silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        contract.check_trl_version()


# ---------------------------------------------------------------------------------------------------- the gate
@pytest.fixture
def untested(monkeypatch, tmp_path, tiny_model_path):
    """The installed TRL as if it were an untested release, an empty Hugging Face cache, the tiny model in `tmp_path`,
    and `trl-lopti check` replaced by a recorder that gives the verdict `untested.outcome` as the check would."""
    import shutil

    shutil.copytree(tiny_model_path, tmp_path / "model")
    monkeypatch.setattr(contract, "TESTED_TRL_RELEASES", ("0.0.0",))
    monkeypatch.setattr(contract, "_verdicts_of_this_process", {})
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for variable in ("GROUP_RANK", "ACCELERATE_TEST_MARKER", "TORCHELASTIC_TEST_MARKER", "NOT_A_LAUNCHER_RANK"):
        monkeypatch.setenv(variable, "0")
    checks = []

    def run_check(command, env, check):
        checks.append(command)
        # The launcher's variables are not passed on; the others are.
        assert not {"GROUP_RANK", "ACCELERATE_TEST_MARKER", "TORCHELASTIC_TEST_MARKER"} & set(env)
        assert env["NOT_A_LAUNCHER_RANK"] == "0" and env["HF_HOME"] == os.environ["HF_HOME"]
        trainer = command[command.index("--trainers") + 1]
        key = contract.verdict_key(trainer, command[command.index("--device") + 1], command[-3])
        verdict = {"key": key, "outcome": checks.outcome}
        if checks.outcome == "failed":
            verdict.update(broken_facts=["R1"], failed_checks=["FAIL  R1  rloo off: the masked sum ..."])
        if checks.outcome == "inconclusive":
            verdict["reason"] = "grpo off: OutOfMemoryError: CUDA out of memory"
        if checks.outcome is None:
            return subprocess.CompletedProcess(command, -9)
        Path(command[-1]).write_text(json.dumps(contract.write_verdict(verdict)))
        return subprocess.CompletedProcess(command, 0)

    checks = type("Checks", (list,), {"outcome": "passed"})()
    monkeypatch.setattr(contract.subprocess, "run", run_check)
    return checks


def build(tmp_path, trainer_class=LoptiGRPOTrainer, **overrides):
    config_class = LoptiRLOOConfig if trainer_class is LoptiRLOOTrainer else None
    config = small_config(tmp_path / "out", config_class, **overrides)
    dataset = conversational_dataset()
    return trainer_class(model=str(tmp_path / "model"), reward_funcs=length_reward, args=config, train_dataset=dataset)


def test_an_untested_release_checks_once_per_trainer_and_precision_then_trains(untested, tmp_path):
    build(tmp_path)
    expected = "check --trainers grpo --device cpu --precision bf16 --verdict_file"
    assert [" ".join(command[3:-1]) for command in untested] == [expected]
    # The cached verdict: no second check, in this process or another.
    build(tmp_path)
    contract._verdicts_of_this_process.clear()
    build(tmp_path)
    assert len(untested) == 1
    # Another trainer, another precision: other verdicts.
    build(tmp_path, LoptiRLOOTrainer)
    build(tmp_path, bf16=False)
    assert [command[5] for command in untested] == ["grpo", "rloo", "grpo"] and untested[-1][-3] == "fp32"


def test_a_failed_verdict_refuses_to_train_naming_the_broken_facts_and_is_kept(untested, tmp_path):
    untested.outcome = "failed"
    with pytest.raises(
        RuntimeError, match=r"breaks trl_lopti's contract for LoptiRLOOTrainer .* R1 \(RLOO generation\)"
    ):
        build(tmp_path, LoptiRLOOTrainer)
    contract._verdicts_of_this_process.clear()
    with pytest.raises(RuntimeError, match=r"(?s)The verdict is kept in .*/rloo-.*pip install 'trl==") as error:
        build(tmp_path, LoptiRLOOTrainer)
    assert len(untested) == 1, "a failed verdict is not checked again"
    print(error.value)  # noqa: T201 - what a user sees (pytest -s)


def test_an_rloo_only_break_leaves_the_grpo_trainer_training(tmp_path, tiny_model_path, monkeypatch, single_thread):
    """The real check of both trainers, with RLOO's fact R1 broken: the GRPO verdict passes and trains, the RLOO verdict
    refuses, naming R1, and neither trainer checks again."""
    import shutil

    shutil.copytree(tiny_model_path, tmp_path / "model")
    monkeypatch.setattr(contract, "TESTED_TRL_RELEASES", ("0.0.0",))
    monkeypatch.setattr(contract, "_verdicts_of_this_process", {})
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    # The old_logps mutation breaks fact R1.
    TRL_MUTATIONS["old_logps not the first forward"][1](monkeypatch, RLOOTrainer)
    assert main(["--precision", "bf16"]) == 1
    monkeypatch.setattr(contract.subprocess, "run", lambda *args, **kwargs: pytest.fail("checked again"))
    build(tmp_path).train()
    with pytest.raises(RuntimeError, match=r"for LoptiRLOOTrainer on this machine \(cpu, bf16\): broken facts R1"):
        build(tmp_path, LoptiRLOOTrainer)


def test_an_inconclusive_check_refuses_without_caching_and_names_the_skip_variable(untested, tmp_path):
    untested.outcome = "inconclusive"
    with pytest.raises(RuntimeError, match=r"could not confirm .* OutOfMemoryError.* TRL_LOPTI_SKIP_CHECK=1") as error:
        build(tmp_path)
    print(error.value)  # noqa: T201 - what a user sees (pytest -s)
    # Nothing cached: the next run checks again, and an interrupted check gives no verdict either.
    untested.outcome = None
    with pytest.raises(RuntimeError, match=r"ended with exit code -9 before a verdict.*Nothing was cached"):
        build(tmp_path)
    assert len(untested) == 2 and not list((tmp_path / "hf").rglob("*.json"))


def test_an_unwritable_cache_never_stops_a_passing_run(untested, tmp_path, monkeypatch):
    # HF_HOME names a file: no folder can be made in it, even by root.
    (tmp_path / "not_a_folder").write_text("")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "not_a_folder"))
    with pytest.warns(UserWarning, match=r"holds for this process only: .*not_a_folder/trl_lopti/contract") as caught:
        build(tmp_path).train()
    assert len([w for w in caught if "holds for this process only" in str(w.message)]) == 1
    # The verdict holds for the process: no second check, no second warning.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*holds for this process only")
        build(tmp_path)
    assert len(untested) == 1


def test_the_skip_variable_trains_without_the_check_and_warns_once(untested, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_LOPTI_SKIP_CHECK", "1")
    monkeypatch.setattr(contract, "_warned_skip", False)
    with pytest.warns(UserWarning, match=r"TRL_LOPTI_SKIP_CHECK=1: .* without `trl-lopti check`\. .*runtime checks"):
        build(tmp_path).train()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="TRL_LOPTI_SKIP_CHECK")
        build(tmp_path, LoptiRLOOTrainer)
    assert untested == []


@pytest.mark.slow
def test_the_first_run_of_an_untested_release_under_two_processes_checks_once(tiny_model_path, tmp_path):
    """torchrun, 2 gloo processes, an empty cache: the first process runs the real check in a process of its own while
    the other waits, then both build their trainer and train."""
    torchrun("gate_script.py", 2, tiny_model_path, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [report["trained_steps"] for report in reports] == [2, 2]
    assert sum(report["ran_check"] for report in reports) == 1
    [verdict_file] = (tmp_path / "hf" / "trl_lopti" / "contract").glob("grpo-*.json")
    assert json.loads(verdict_file.read_text())["outcome"] == "passed"


def test_machines_whose_caches_differ_meet_at_the_gate(tiny_model_path, tmp_path):
    """torchrun's two nodes (a process each, on this machine), each with a cache of its own: the first holds a passing
    verdict, the second none. The second runs the check while the first waits for it at the gate, then both train (a
    process that skipped the gate's collective would leave the others waiting there for ever)."""
    port = str(free_port())
    processes = []
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
    [verdict_file] = (tmp_path / "hf1" / "trl_lopti" / "contract").glob("grpo-*.json")
    assert json.loads(verdict_file.read_text())["outcome"] == "passed"


def test_a_machine_that_refuses_stops_every_machine_of_the_run(tiny_model_path, tmp_path):
    """torchrun's two nodes, each with a cache of its own: the first holds a passing verdict, the second a failed one.
    Every process refuses, at once: none trains, and none waits for the others in vain."""
    port = str(free_port())
    processes = []
    environment = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    script = str(Path(__file__).with_name("gate_script.py"))
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node)]
        command += ["--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port]
        command += [script, tiny_model_path, str(tmp_path), "other_machine_refuses"]
        processes.append(subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [process.communicate(timeout=300)[0].decode() for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert all(process.returncode != 0 for process in processes), [output[-2000:] for output in outputs]
    assert "Another machine of this run refuses to train. There: TRL" in outputs[0], outputs[0][-3000:]
    assert (
        "breaks trl_lopti's contract for LoptiGRPOTrainer on this machine (cpu, bf16): broken facts S4" in outputs[1]
    )
    assert not list(tmp_path.glob("rank*.json")), "no process trained"


def test_a_relation_that_names_no_fact_is_inconclusive_and_not_cached(monkeypatch, tmp_path, capsys, single_thread):
    """A relation beyond its tolerance, with no fact named (a device's rounding can do it): the check refuses the run
    but caches nothing, names no fact, and says how to train anyway (exit code 3)."""
    from trl_lopti import check

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    # Every relation misses a tolerance below zero; no runtime check breaks.
    monkeypatch.setitem(check.TOLERANCES, "fp64", -1.0)
    assert main(["--trainers", "grpo", "--precision", "fp64"]) == 3
    output = capsys.readouterr().out
    assert "FAIL " in output and "relative difference" in output and "broken facts" not in output
    assert "grpo: inconclusive (not cached: the next run checks again)" in output
    assert not (tmp_path / "hf").exists()
