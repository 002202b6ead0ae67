"""What trl_lopti relies on in TRL: the releases it was tested with, the TRL facts, checked while training, the gate of
an untested release, and the few adapters to TRL's private interface.

`trl_lopti.config` and the trainer modules import this module before they import TRL; `trl_lopti.tasks` does not import
TRL at all.

The trainers rely on the TRL facts below (`TRL_FACTS`), unchanged from 1.10 to 1.16 (`.ci/run` tests each minor
release's newest patch). The `check_*` function named beside each checks it in every training run, at no measurable
cost, and stops the run at the first step where it fails ([`broken_fact`]); tests/test_fact_checks.py breaks each on
purpose. S holds for both trainers (`lopti_mixin.py`), G for `GRPOTrainer` (`grpo_trainer.py`,
`reinforce_plus_plus.py`), R for `RLOOTrainer` (`rloo_trainer.py`).

- S1. Schedule. `_prepare_inputs` generates when `self._step % (steps_per_generation * self.num_iterations) == 0` (or
  with nothing buffered), buffers the batch split into micro-batches in `self._buffered_inputs` (0-dim tensors copied
  into each) and serves slice `self._step % steps_per_generation`, the same dicts until the next generation;
  `training_step` then increments `self._step`. Checked: a generation happens only at a cycle's first micro-step, and
  a micro-batch carries the mark of its first training exactly when it is trained again (`check_generation`,
  `check_micro_batch`).
- S2. Dataloader. The train sampler repeats each generation batch `self.num_iterations * steps_per_generation` times,
  reading `self.num_iterations` when the dataloader is built. Checked: the dataloader serves the same generation batch
  (its prompts) at every micro-step of a cycle (`check_micro_step`).
- S3. Loss forward. `_compute_loss(model, inputs)` calls `self._get_per_token_logps_and_entropies` once for the policy
  (taking `batch_size=` and the same arguments in both trainers, returning log-probabilities, entropies and an
  auxiliary loss), and its loss is differentiated through the log-probabilities that call returns. Checked: what every
  call returned, one forward per loss, and the backward reaches it (`check_forward_output`, `check_loss_call`,
  `check_backward`).
- S4. Checkpoints. `_save_checkpoint` and `_load_optimizer_and_scheduler` are the extension points for trainer state
  (TRL's entropy controller uses them); transformers calls the latter on resume after `self.state` is loaded. Checked:
  the state is loaded there, and at each accumulation window `self._step` sits where the optimizer steps put it
  (`check_resumed_state`, `check_micro_step`).
- S5. Logging. `log` averages and clears the lists in `self._metrics[mode]`, and reads `self._logs` (the completions
  table) only when `self.log_completions` is true at that call. Checked after every log (`check_log`).
- S6. Loss mask. Every loss sums its per-token terms over `completion_mask` (times `tool_mask` where the batch has one):
  no gradient reaches the log-probability of a token outside it (padding, masked tool output), which belongs to
  neither Lopti group. Checked in every backward: the gradient reaching the log-probabilities handed to TRL's loss is
  zero outside that mask (`check_backward`).
- G1. GRPO loss. `_compute_loss(model, inputs)` reads `inputs["advantages"]` (token-level (B, T) accepted) only after
  its policy forward, and returns the micro-step's share of its optimizer step's loss. Checked at every loss: it read
  the advantages AR placed during the forward, and nothing else (`check_loss_call`).
- G2. GRPO generation. `_generate_and_score_completions` returns `old_per_token_logps` whenever the policy moves
  between the batch's generation and its training (`gradient_accumulation_steps` not a multiple of
  `steps_per_generation * self.num_iterations`) or vLLM importance sampling needs it. Checked at every split without
  pi_old: no optimizer step came between the generation and that micro-batch (`check_on_policy`).
- G3. GRPO rewards. `_generate_and_score_completions` calls `self._calculate_rewards` once per generation batch, which
  returns the rewards of every completion of the batch (all processes, in process order), one column per reward
  function; this process's completions are the `process_index`-th slice of that order. Checked at every generation
  batch: one call, one row per completion of every process.
- G4. GRPO logs. `_generate_and_score_completions` appends the batch's advantages (all processes) to
  `self._logs["advantages"]`, which the completions table shows; REINFORCE++'s take their place there. Checked at every
  generation batch: this process's slice of the last ones appended is the advantages TRL returned.
- R1. RLOO generation. `_generate_and_score_completions` computes pi_old with its first
  `_get_per_token_logps_and_entropies` call (the policy, no gradient, before the reference model's) and returns its
  masked sum as `old_logps` (B,). Checked at every generation batch.
- R2. RLOO loss. `_compute_loss(model, inputs)` sums the log-probabilities of its one policy forward over
  `completion_mask` (no `tool_mask`) and reads `old_logps` and `advantages` (B,); it returns the micro-batch's mean loss
  (the Trainer divides it by the gradient accumulation). Checked at every generation batch (no `tool_mask`) and,
  through S3, at every loss.

No release is refused at import: on one outside `TESTED_TRL_RELEASES` the import warns once, and the trainers train
only once `trl-lopti check` has passed on the machine for that stack (`require_verified_contract`; docs/releases.md).
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


MINIMUM_TRL = "1.10.0"
"""The oldest TRL release `setup.cfg` admits (no upper bound): the oldest on which the contract holds."""
TESTED_TRL_RELEASES = ("1.10.0", "1.11.0", "1.12.0", "1.13.0", "1.14.2", "1.16.0")
"""The releases `.ci/run` tests (the newest patch of each minor release it passes on); on any other, the trainers train
once `trl-lopti check` has passed on the machine (`require_verified_contract`)."""
CHECK_COMMAND = "trl-lopti check"
LAUNCHER_VARIABLES = re.compile(r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|MASTER_PORT"
                                r"|OMP_NUM_THREADS)$|ACCELERATE_|TORCHELASTIC|OMPI_|PMI_|PMIX_|MV2_")  # fmt: skip
"""What a launcher sets in each process it starts (accelerate's, torchelastic's and MPI's by prefix): not passed to the
check's own process."""

TRL_FACTS = dict(re.findall(r"^- ([SGR]\d)\. ([^.]+)\.", __doc__, re.MULTILINE))
"""The TRL facts the trainers rely on, by number, each stated in this module's docstring (its heading here), checked
while training and pinned by `tests/test_trl_contract.py`."""


def broken_fact(number: str, saw: str) -> RuntimeError:
    """The error of a runtime check: the installed TRL no longer behaves as fact `number` of `TRL_FACTS` states, and
    `saw` says what the check saw. Training stops at the first step where it happens."""
    return RuntimeError(
        f"TRL {TRL_VERSION} broke fact {number} of trl_lopti ({TRL_FACTS[number]}, docs/releases.md): {saw}. Training "
        "stops here rather than train an update other than the method's"
    )


class ReadRecorder(dict):
    """A dict that records every value read from it by key (`reads`): what TRL's code read (facts G1, S5)."""

    def __init__(self, values: dict[str, Any]):
        super().__init__(values)
        self.reads: dict[str, list[Any]] = {}

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        self.reads.setdefault(key, []).append(value)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default  # noqa: SIM401 (dict.get would skip __getitem__)


def check_forward_output(output: Any) -> None:
    """Fact S3: TRL's log-prob forward returned (log-probabilities, entropies, auxiliary loss)."""
    if not isinstance(output, tuple) or len(output) != 3:
        saw = f"{len(output)} values" if isinstance(output, tuple) else type(output).__name__
        raise broken_fact("S3", f"_get_per_token_logps_and_entropies returned {saw}, not (logps, entropies, aux_loss)")


def check_generation(position: int, cycle: int) -> None:
    """Fact S1: a training generation batch is generated at micro-step `position` of a `cycle`-micro-step cycle."""
    if position:
        raise broken_fact("S1", f"TRL generated at micro-step {position} of a {cycle}-micro-step cycle")


def prompts_of(generation_batch: Any) -> list[Any] | None:
    """The prompts of a generation batch as TRL's dataloader serves it (a list of rows), for fact S2."""
    return [row.get("prompt") for row in generation_batch] if isinstance(generation_batch, list) else None


def check_micro_step(
    step: int, global_step: int, accumulation: int, cycle: int, prompts: Any, cycle_prompts: Any
) -> None:
    """Facts S4 and S2, at the start of training micro-step `step` (TRL's `_step`) after `global_step` optimizer steps
    of `accumulation` micro-steps, in a `cycle`-micro-step cycle: the dataloader served the `prompts` it served at the
    cycle's first micro-step (`cycle_prompts`)."""
    if cycle % accumulation == 0 and step % accumulation == 0 and (global_step * accumulation - step) % cycle:
        raise broken_fact(
            "S4",
            f"at optimizer step {global_step} TRL's micro-step counter _step is {step}, which is not where "
            f"{accumulation} micro-steps per optimizer step put it in a {cycle}-micro-step cycle (a resumed run whose "
            "_load_optimizer_and_scheduler did not run?)",
        )
    if prompts != cycle_prompts:
        raise broken_fact(
            "S2",
            f"at micro-step {step % cycle} of a {cycle}-micro-step cycle the dataloader served other prompts than at "
            "its first: each pass must train the generation batch the first pass trained",
        )


def check_micro_batch(position: int, first_position: int | None, trained_at: int | None) -> None:
    """Fact S1: the micro-batch served at micro-step `position` of its cycle was first trained at `trained_at` (`None`:
    never); it must be at `first_position` of this cycle (`None`: it is its first training)."""
    if first_position is None and trained_at is not None:
        raise broken_fact("S1", f"micro-step {position} of a cycle got a micro-batch trained in an earlier cycle")
    if first_position is not None and trained_at != first_position:
        raise broken_fact(
            "S1",
            f"micro-step {position} of its cycle got another micro-batch (or a copy of it) than the one trained at "
            f"micro-step {first_position}, whose split and pi_old it must reuse",
        )


def check_loss_call(policy_forwards: int, placed: dict, reads: dict, placement_fact: str) -> None:
    """Facts S3 and (`placement_fact`) G1, after a loss: TRL ran `policy_forwards` policy forwards, and read (`reads`:
    the values read, by key) every value placed in its inputs during the forward (`placed`, by key)."""
    if policy_forwards != 1:
        raise broken_fact("S3", f"_compute_loss ran {policy_forwards} policy forwards, not one")
    for key, value in placed.items():
        if not reads.get(key) or any(seen is not value for seen in reads[key]):
            raise broken_fact(placement_fact, f"TRL's loss did not read the {key} placed during its forward")


def check_backward(reached: bool, gradient_outside_the_mask: float) -> None:
    """Facts S3 and S6, after a training step: its backward `reached` the log-probabilities handed to TRL's loss, and
    what reached the tokens outside the loss mask (the sum of its absolute values) is zero."""
    if not reached:
        raise broken_fact("S3", "the backward of the training step never reached the log-probabilities of the loss")
    if gradient_outside_the_mask != 0:
        raise broken_fact("S6", f"a gradient of {gradient_outside_the_mask:.3g} reached tokens outside the loss mask")


def check_on_policy(step: int, position: int, accumulation: int) -> None:
    """Fact G2: a micro-batch first trained at micro-step `step` (`position` of its cycle) came without pi_old, so no
    optimizer step (every `accumulation` micro-steps) may lie between its generation and now."""
    if (step - position) // accumulation != step // accumulation:
        raise broken_fact(
            "G2",
            f"no pi_old (old_per_token_logps) came with a micro-batch first trained at micro-step {position} of its "
            "cycle, after an optimizer step: its own forward is no longer pi_old",
        )


def check_log(kept_metrics: list[str], rewrote_table: bool) -> None:
    """Fact S5, after a log: the metrics `log` kept, and whether it read the completions table while told not to."""
    if kept_metrics:
        raise broken_fact("S5", f"log kept {len(kept_metrics)} averaged metrics, e.g. {', '.join(kept_metrics[:3])}")
    if rewrote_table:
        raise broken_fact("S5", "log wrote a generation batch's completions table again, with log_completions off")


def check_resumed_state(global_step: int) -> None:
    """Fact S4: a checkpoint inside a generation batch (at least one optimizer step in) is resumed with the trainer
    state at `global_step` loaded."""
    if global_step == 0:
        raise broken_fact("S4", "_load_optimizer_and_scheduler ran before the trainer state was loaded")


def stack_versions() -> dict[str, str]:
    """The versions a verdict of `trl-lopti check` holds for: TRL, transformers, trl_lopti (and torch, recorded)."""
    return {package: version(package) for package in ("trl", "transformers", "trl_lopti", "torch")}


def verdict_path() -> Path:
    """Where `trl-lopti check` caches its verdict for this TRL, transformers and trl_lopti: in the Hugging Face cache
    folder (`HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`)."""
    cache = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    versions = stack_versions()
    name = f"trl-{versions['trl']}_transformers-{versions['transformers']}_trl_lopti-{versions['trl_lopti']}.json"
    return Path(cache).expanduser() / "trl_lopti" / "contract" / name


def read_verdict() -> dict[str, Any] | None:
    """The cached verdict of `trl-lopti check` for this stack, `None` where it never ran."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads(verdict_path().read_text())
    return None


_verifying_contract = False  # while `trl-lopti check` runs its own trainers


def verifying_contract() -> contextlib.AbstractContextManager:
    """The block runs the contract's own training runs: the trainers' gate lets them train."""
    from .utils import temporarily_set

    return temporarily_set(sys.modules[__name__], _verifying_contract=True)


def require_verified_contract() -> None:
    """
    The gate of an untested TRL release (outside `TESTED_TRL_RELEASES`): a Lopti trainer trains only once `trl-lopti
    check` has passed on this machine for this stack (`verdict_path`). Where it never ran, the first process of each
    machine runs it once, in a process of its own (without the launcher's settings), while every other process of every
    machine waits (accelerate's `local_main_process_first`), and caches its verdict; a failed verdict refuses to train,
    naming the broken facts.
    """
    if TRL_VERSION in TESTED_TRL_RELEASES or _verifying_contract:
        return
    from accelerate import PartialState

    state, verdict = PartialState(), read_verdict()
    if verdict is None or state.num_processes > 1:  # every process meets the barrier: another machine may need it
        with state.local_main_process_first():
            verdict = read_verdict()
            if verdict is None and state.is_local_main_process:  # it runs the check, the others read its verdict
                environment = {k: v for k, v in os.environ.items() if not LAUNCHER_VARIABLES.match(k)}
                sys.stderr.write(f"trl_lopti: TRL {TRL_VERSION} is untested: running `{CHECK_COMMAND}` once\n")
                subprocess.run([sys.executable, "-m", "trl_lopti", "check"], env=environment, check=False)
                verdict = read_verdict()
    if verdict is None:
        raise RuntimeError(f"TRL {TRL_VERSION}: `{CHECK_COMMAND}` gave no verdict; run it and read what it says")
    if not verdict["passed"]:
        raise RuntimeError(
            f"TRL {TRL_VERSION} failed trl_lopti's contract on this machine ({CHECK_COMMAND}, cached in "
            f"{verdict_path()}): broken facts {', '.join(verdict['broken_facts']) or 'none named'}. "
            + " ".join(verdict["failed"])[:1500]
            + f" Install a tested release (pip install 'trl=={TESTED_TRL_RELEASES[-1]}'), or see docs/releases.md."
        )


def check_trl_version() -> str:
    """The installed TRL version; a warning naming it where it is not among `TESTED_TRL_RELEASES`."""
    try:
        installed = version("trl")
    except PackageNotFoundError as error:
        raise ImportError(f"trl_lopti needs TRL: pip install 'trl>={MINIMUM_TRL}'") from error
    if installed not in TESTED_TRL_RELEASES:
        warnings.warn(
            f"trl_lopti was tested with TRL {', '.join(TESTED_TRL_RELEASES)}, not with the installed TRL {installed}: "
            f"its trainers train once `{CHECK_COMMAND}` has passed on this machine for it (they run it once, about 10 "
            "seconds on a CPU, and cache the verdict); a failed check names the TRL facts that broke",
            UserWarning,
            stacklevel=2,
        )
    return installed


TRL_VERSION = check_trl_version()
"""The installed TRL version."""
