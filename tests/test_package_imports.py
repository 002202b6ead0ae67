"""`trl_lopti.tasks` (puzzles, rewards, graders, data) needs no TRL; the trainer reads the TRL version first.

Each test runs a fresh interpreter whose path starts with a fake `trl`: a package whose import raises, with metadata
saying TRL 1.17.0 is installed. Anything that imports TRL fails loudly there, including the time-limit worker
processes the graders start (they inherit the path).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


FAKE_TRL_VERSION = "1.17.0"


@pytest.fixture
def run_without_trl(tmp_path):
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("raise ImportError('the fake trl was imported')\n")
    dist_info = tmp_path / f"trl-{FAKE_TRL_VERSION}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: trl\nVersion: {FAKE_TRL_VERSION}\n")
    repository = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repository)])}

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    return run


def test_tasks_import_and_work_without_trl(run_without_trl):
    result = run_without_trl("""
        import sys, threading
        import trl_lopti
        from trl_lopti.tasks import generate_dataset, knights_knaves_reward, paper_prompt
        from trl_lopti.tasks._time_limit import WorkerProcess

        dataset = generate_dataset([3], num_samples=2, seed=0)
        print("kk", knights_knaves_reward(["<think>x</think><answer>no</answer>"], dataset[:1]["solution_text_format"]))
        print("prompt", paper_prompt(dataset[0]["quiz"]).startswith("<|im_start|>system"))
        # a worker process imports a tasks module by name, as the graders' workers do
        worker = WorkerProcess("trl_lopti.tasks._text:completion_to_text", warmup_args=("warm",))
        print("worker", worker.call(("hello",), timeout_seconds=60))
        worker.close()
        print("trl imported:", "trl" in sys.modules, trl_lopti.__version__)
    """)
    assert result.returncode == 0, result.stderr
    assert "worker hello" in result.stdout and "prompt True" in result.stdout
    assert "kk [" in result.stdout
    assert "trl imported: False" in result.stdout


def test_trainer_import_names_an_untested_trl_release_before_importing_trl(run_without_trl):
    """An untested release (the fake TRL 1.17.0) is named in one warning before TRL itself is imported (which the fake
    one refuses: a real one would import, and the trainers then train once `trl-lopti check` passed)."""
    for name in ("LoptiGRPOTrainer", "LoptiGRPOConfig"):
        result = run_without_trl(f"""
            import sys, warnings
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    from trl_lopti import {name}
                except ImportError as error:
                    print("error:", error)
            print("warned:", [str(warning.message) for warning in caught])
        """)
        assert result.returncode == 0, result.stderr
        assert "error: the fake trl was imported" in result.stdout
        warned = next(line for line in result.stdout.splitlines() if line.startswith("warned:"))
        assert f"not with the installed TRL {FAKE_TRL_VERSION}" in warned and warned.count("trl-lopti check") == 1


def test_package_exports_the_trainer_lazily():
    import trl_lopti
    from trl_lopti.config import LoptiGRPOConfig
    from trl_lopti.grpo_trainer import LoptiGRPOTrainer

    assert trl_lopti.LoptiGRPOTrainer is LoptiGRPOTrainer and trl_lopti.LoptiGRPOConfig is LoptiGRPOConfig
    assert {"LoptiGRPOConfig", "LoptiGRPOTrainer"} <= set(dir(trl_lopti))
    with pytest.raises(AttributeError, match="no attribute 'not_there'"):
        trl_lopti.not_there  # noqa: B018
