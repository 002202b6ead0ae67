"""Run by tests/test_check.py under torchrun (2 gloo processes): the first training run on an untested TRL release,
with an empty Hugging Face cache, shared by the processes of one machine or (`two_machines`: torchrun's two nodes) one
per machine, the first of which already holds a passing verdict (`other_machine_refuses`: and the second a failed one).
Writes, per process, the optimizer steps it trained and whether it ran the check."""

import json
import os
import sys
from pathlib import Path


def main(model_path: str, folder: str, machines: str = "one_machine") -> None:
    node = os.environ["GROUP_RANK"] if machines != "one_machine" else ""
    os.environ["HF_HOME"] = os.path.join(folder, f"hf{node}")
    import trl_lopti.trl_contract as contract

    # The installed TRL, as if it were untested.
    contract.TESTED_TRL_RELEASES = ("0.0.0",)
    # This machine ran `trl-lopti check` before.
    key = contract.verdict_key("grpo", "cpu", "bf16")
    if node == "0":
        contract.write_verdict({"key": key, "outcome": "passed"})
    # The other machine found a fact broken before.
    if node == "1" and machines == "other_machine_refuses":
        failed = {
            "key": key,
            "outcome": "failed",
            "broken_facts": ["S4"],
            "failed_checks": ["FAIL  S4  grpo isolation"],
        }
        contract.write_verdict(failed)
    ran, run = [], contract.subprocess.run

    def recorded(*args, **kwargs):
        ran.append(args[0])
        return run(*args, **kwargs)

    contract.subprocess.run = recorded
    from testing_utils import conversational_dataset, length_reward, small_config

    from trl_lopti import LoptiGRPOTrainer

    config = small_config(Path(folder) / "out", max_steps=2)
    trainer = LoptiGRPOTrainer(model_path, length_reward, config, conversational_dataset())
    trainer.train()
    report = {"trained_steps": trainer.state.global_step, "ran_check": len(ran)}
    (Path(folder) / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
