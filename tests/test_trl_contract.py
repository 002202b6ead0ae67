"""The TRL behaviour the trainers rely on, checked by running it, under the codes of `trl_lopti.trl_contract.TRL_FACTS`:
S1-S4 for both `GRPOTrainer` and `RLOOTrainer`, G1-G3 for `GRPOTrainer`, R1-R2 for `RLOOTrainer` (all stated in
trl_lopti/trl_contract.py; tests/test_fact_checks.py breaks each on purpose and sees the trainer's runtime check stop it),
and what the completions table relies on, which no fact guards (it shows no update).

Each test exercises TRL's own trainers (spies, counters, a 2-process run), so it fails when TRL's behaviour changes and
not when its source is reformatted. Run this file first when upgrading TRL: a failure names the fact that changed.
"""

import importlib.metadata
import json

import pytest
import torch
from datasets import Dataset, IterableDataset
from testing_utils import COMPLETION_LENGTH, TEMPERATURE, fixed_generation_batch, torchrun
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

import trl_lopti.trl_contract as contract
from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer, LoptiRLOOConfig, LoptiRLOOTrainer


def reward(completions, **kwargs):
    return [0.0] * len(completions)


TRL_TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}
LOPTI = {"grpo": (LoptiGRPOTrainer, LoptiGRPOConfig), "rloo": (LoptiRLOOTrainer, LoptiRLOOConfig)}


def grpo_trainer(model_path, output_dir, trainer: str = "grpo", **overrides) -> GRPOTrainer | RLOOTrainer:
    """TRL's own trainer (`trainer`: "grpo" or "rloo") on the tiny model, with these config overrides."""
    trainer_class, config_class = TRL_TRAINERS[trainer]
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        logging_steps=1,
        shuffle_dataset=False,
    )
    values.update(overrides)
    dataset = Dataset.from_dict({"prompt": [f"p{i}" for i in range(16)]})
    trainer = trainer_class(model=model_path, reward_funcs=reward, args=config_class(**values), train_dataset=dataset)
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop; a loss outside it needs it
    return trainer


class ReadRecorder(dict):
    """A micro-batch that records, in `events`, every key read from it."""

    def __init__(self, values, events):
        super().__init__(values)
        self.events = events

    def __getitem__(self, key):
        self.events.append(("read", key))
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.events.append(("read", key))
        return super().get(key, default)


# ------------------------------------------------------------------------------------------------------ S2, G1
def test_compute_loss_runs_one_policy_forward_and_reads_advantages_and_pi_old_after_it(
    tiny_model_path, tmp_path, monkeypatch
):
    trainer = grpo_trainer(tiny_model_path, tmp_path, beta=0.1)
    batch, _ = fixed_generation_batch(tiny_model_path, 2, seed=0, beta=0.1)
    with torch.no_grad():
        batch["old_per_token_logps"] = batch["ref_per_token_logps"] + 0.1
    events = []
    forward = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, *args, **kwargs):
        events.append(("forward", "policy" if model is trainer.model else "other"))
        return forward(self, model, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, ReadRecorder(batch, events))
    assert torch.isfinite(loss) and loss.requires_grad
    assert events.count(("forward", "policy")) == 1 and ("forward", "other") not in events
    forward_at = events.index(("forward", "policy"))
    for key in ("advantages", "old_per_token_logps", "ref_per_token_logps"):
        reads = [i for i, event in enumerate(events) if event == ("read", key)]
        assert reads and min(reads) > forward_at, f"{key} is read before the policy forward: {events}"


def test_compute_loss_accepts_token_level_advantages(tiny_model_path, tmp_path):
    """(B, T) advantages: equal columns give the (B,) loss; on-policy DAPO is -sum(A * mask) / tokens."""
    trainer = grpo_trainer(tiny_model_path, tmp_path)
    batch, _ = fixed_generation_batch(tiny_model_path, 2, seed=1, beta=0.0)
    trainer.model.train()
    sequence_level = trainer.compute_loss(trainer.model, dict(batch))
    token_level = dict(batch, advantages=batch["advantages"][:, None].expand(-1, COMPLETION_LENGTH).clone())
    torch.testing.assert_close(trainer.compute_loss(trainer.model, token_level), sequence_level)
    per_token = torch.linspace(-1.0, 2.0, 2 * COMPLETION_LENGTH).view(2, COMPLETION_LENGTH)
    loss = trainer.compute_loss(trainer.model, dict(batch, advantages=per_token))
    mask = batch["completion_mask"].float()
    expected = -(per_token * mask).sum() / mask.sum()  # ratio 1 at the behaviour policy
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------ S1
@pytest.mark.parametrize("trl_trainer", list(TRL_TRAINERS))
def test_prepare_inputs_generates_every_steps_per_generation_times_num_iterations_micro_steps(
    tiny_model_path, tmp_path, trl_trainer
):
    steps_per_generation, num_iterations, gradient_accumulation_steps, optimizer_steps = 2, 2, 2, 4
    trainer = grpo_trainer(
        tiny_model_path,
        tmp_path,
        trl_trainer,
        steps_per_generation=steps_per_generation,
        num_iterations=num_iterations,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_steps=optimizer_steps,
    )
    rows = 2 * steps_per_generation
    generations, served = [], []

    def fixed_batch(generation_batch):
        batch, _ = fixed_generation_batch(tiny_model_path, rows, seed=len(generations), beta=0.0)
        batch["old_logps"] = torch.zeros(rows)  # RLOO's loss reads it
        batch["row_id"] = torch.arange(rows) + 100 * len(generations)
        generations.append(trainer._step)
        return batch

    compute_loss = trainer.compute_loss

    def record(model, inputs, *args, **kwargs):
        served.append((trainer._step, sorted(inputs["row_id"].tolist())))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer._generate_and_score_completions = fixed_batch
    trainer.compute_loss = record
    trainer.train()
    micro_steps = optimizer_steps * gradient_accumulation_steps
    generate_every = steps_per_generation * num_iterations
    assert trainer._step == micro_steps, "training_step counts every micro-step in _step"
    assert generations == list(range(0, micro_steps, generate_every))
    assert [step for step, _ in served] == list(range(micro_steps))
    for cycle in range(micro_steps // generate_every):
        slices = [rows_served for step, rows_served in served[cycle * generate_every : (cycle + 1) * generate_every]]
        # slice `_step % steps_per_generation` of the buffered batch: the two slices partition it, then repeat
        assert sorted(slices[0] + slices[1]) == [100 * cycle + i for i in range(rows)]
        assert slices[2:] == slices[:2]


@pytest.mark.parametrize("trl_trainer", list(TRL_TRAINERS))
def test_num_iterations_is_read_only_as_the_schedule_and_at_generation(trl_trainer):
    """The one attribute of TRL's the mixin changes: `self.num_iterations`, the user's value times the passes, which
    TRL reads as the times a generation batch is trained (the sampler, the iterable dataset's repeats, the buffer's
    replays), and as the user's value at generation, where GRPO decides whether it needs pi_old (the mixin's swap).
    A TRL that reads it anywhere else fails here, in every release of the matrix."""
    import ast
    import inspect

    trainer_class, _ = TRL_TRAINERS[trl_trainer]
    tree = ast.parse(inspect.getsource(inspect.getmodule(trainer_class)))
    readers = set()
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                # A read of `self.num_iterations`.
                read = isinstance(node, ast.Attribute) and node.attr == "num_iterations"
                read = read and isinstance(node.ctx, ast.Load) and getattr(node.value, "id", None) == "self"
                if read:
                    readers.add(function.name)
    schedule = {"_get_train_sampler", "get_train_dataloader", "_prepare_inputs"}
    assert schedule & readers and readers <= schedule | {"_generate_and_score_completions"}, sorted(readers)


# ------------------------------------ the sampler (no fact: it decides which prompts train, not an update)
@pytest.mark.parametrize("trl_trainer", list(TRL_TRAINERS))
def test_train_sampler_repeats_each_generation_batch_as_num_iterations_says_when_built(
    tiny_model_path, tmp_path, trl_trainer
):
    trainer = grpo_trainer(tiny_model_path, tmp_path, trl_trainer, steps_per_generation=2)
    batches = [
        sorted(batch["prompt"] if isinstance(batch, dict) else [e["prompt"] for e in batch])
        for batch in trainer.get_train_dataloader()
    ]
    trainer.num_iterations = 3  # read while the dataloader is built (Lopti multiplies it by its number of passes)
    repeated = [
        sorted(batch["prompt"] if isinstance(batch, dict) else [e["prompt"] for e in batch])
        for batch in trainer.get_train_dataloader()
    ]
    assert len(repeated) == 3 * len(batches) > 0
    distinct = [b for i, b in enumerate(batches) if i == 0 or b != batches[i - 1]]
    assert [repeated[i] for i in range(0, len(repeated), 3 * len(batches) // len(distinct))] == distinct


@pytest.mark.parametrize("trl_trainer", list(TRL_TRAINERS))
@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "iterable"])
def test_lopti_serves_each_generation_batch_twice(tiny_model_path, tmp_path, iterable, trl_trainer):
    (trainer_class, config_class), (lopti_class, lopti_config_class) = TRL_TRAINERS[trl_trainer], LOPTI[trl_trainer]
    prompts = {"prompt": [f"p{i}" for i in range(8)]}
    dataset = Dataset.from_dict(prompts)
    if iterable:
        dataset = dataset.to_iterable_dataset()
        assert isinstance(dataset, IterableDataset)
    common = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        report_to="none",
        use_cpu=True,
        max_steps=1,
    )
    grpo = trainer_class(
        model=tiny_model_path, reward_funcs=reward, args=config_class(**common), train_dataset=dataset
    )
    lopti = lopti_class(
        model=tiny_model_path, reward_funcs=reward, args=lopti_config_class(**common), train_dataset=dataset
    )
    grpo_batches = list(grpo.get_train_dataloader())
    lopti_batches = list(lopti.get_train_dataloader())
    assert len(lopti_batches) == 2 * len(grpo_batches) > 0
    assert lopti.num_iterations == 2 * lopti.args.num_iterations == 2, "TRL trains each generation batch once per pass"
    # the same prompts, each generation batch served twice in a row
    as_prompts = [
        sorted(example["prompt"] if isinstance(example, dict) else [e["prompt"] for e in example])
        for example in lopti_batches
    ]
    grpo_prompts = [
        sorted(example["prompt"] if isinstance(example, dict) else [e["prompt"] for e in example])
        for example in grpo_batches
    ]
    assert as_prompts[0::2] == grpo_prompts and as_prompts[1::2] == grpo_prompts


# ------------------------------------------------------------------------------------------------------ G3
@pytest.mark.slow
def test_rewards_are_gathered_in_process_order_once_per_generation(tiny_model_path, tmp_path):
    """2 gloo processes: `_calculate_rewards` returns every process's rewards, rank 0's first, once per batch."""
    result_path = tmp_path / "result.json"
    torchrun("ddp_trl_contract_script.py", 2, tiny_model_path, str(tmp_path / "out"), str(result_path))
    result = json.loads(result_path.read_text())
    assert result["world_size"] == 2
    for rank in range(2):
        local, gathered = result["local_rewards"][rank], result["gathered_rewards"][rank]
        assert len(gathered) == 2 == len(local), "two generation batches, each scored once"
        for batch in range(2):
            assert all(100 * rank <= value < 100 * (rank + 1) for value in local[batch]), "tagged with the rank"
            in_process_order = result["local_rewards"][0][batch] + result["local_rewards"][1][batch]
            assert gathered[batch] == in_process_order


# ------------------------------------------------------------------------- the model card, the release, Liger (no fact)
@pytest.mark.parametrize("trl_trainer", list(TRL_TRAINERS))
def test_model_card_reads_the_trainer_name_and_paper(tiny_model_path, tmp_path, trl_trainer):
    trainer = grpo_trainer(tiny_model_path, tmp_path, trl_trainer)
    trainer._name = "Contract-Check"
    trainer._paper = {"title": "A Title To Find", "id": "1234.56789", "citation": "@article{contract_check}"}
    trainer.create_model_card(model_name="contract")
    card = (tmp_path / "README.md").read_text()
    for expected in ("Contract-Check", "A Title To Find", "1234.56789", "@article{contract_check}"):
        assert expected in card, expected


def test_the_installed_trl_imports_and_its_release_is_named():
    """`TRL_VERSION` names the release of the TRL that `import trl` loads: the version in the metadata of the installed
    distribution whose record lists the very file imported (not another copy that comes first on the path), read here
    without trl_lopti. tests/test_check.py covers the warning on an untested release and the error without TRL."""
    from pathlib import Path

    import trl

    distribution = importlib.metadata.distribution("trl")
    imported = Path(trl.__file__).resolve()
    recorded = {Path(distribution.locate_file(file)).resolve() for file in distribution.files or []}
    assert imported in recorded, f"{imported} is no file of the installed trl {distribution.metadata['Version']}"
    assert contract.TRL_VERSION == distribution.metadata["Version"]


def test_the_declared_requirement_is_the_floor_without_a_cap():
    """pip never downgrades a user's TRL: setup.cfg declares the oldest release the contract holds on, no upper bound,
    no excluded release (an untested one is proven on the user's machine, tests/test_check.py)."""
    import re
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.cfg").read_text()
    [requirement] = re.findall(r"^\s*trl\b.*$", setup.split("[options.extras_require]")[0], re.MULTILINE)
    assert requirement.replace(" ", "") == f"trl>={contract.MINIMUM_TRL}"
    assert min(contract.TESTED_TRL_RELEASES, key=lambda v: tuple(map(int, v.split(".")))) == contract.MINIMUM_TRL


def test_liger_is_refused_at_config_construction_below_the_release_that_routes_it_through_the_log_prob_hook(
    monkeypatch,
):
    monkeypatch.setattr(contract, "TRL_VERSION", "1.13.0")
    with pytest.raises(ValueError, match=r"use_liger_kernel=True: with TRL 1.13.0.*use_liger_kernel=False.*1.14"):
        LoptiGRPOConfig(output_dir="unused", use_cpu=True, use_liger_kernel=True)
    # never refused without Liger
    assert not LoptiGRPOConfig(output_dir="unused", use_cpu=True).use_liger_kernel
    # from 1.14 the Liger loss runs through the log-prob hook: accepted
    monkeypatch.setattr(contract, "TRL_VERSION", "1.14.2")
    assert LoptiGRPOConfig(output_dir="unused", use_cpu=True, use_liger_kernel=True).use_liger_kernel


def test_a_loss_that_no_longer_runs_the_log_prob_forward_stops_the_trainer(tiny_model_path, tmp_path, monkeypatch):
    """The runtime check of fact S2: a TRL whose loss bypasses the hook (as Liger below 1.14 does) fails loudly, at the
    first training step, before an optimizer step."""
    config = LoptiGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=COMPLETION_LENGTH,
        max_steps=2,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trainer = LoptiGRPOTrainer(
        model=tiny_model_path, reward_funcs=reward, args=config, train_dataset=Dataset.from_dict({"prompt": ["p"] * 4})
    )
    monkeypatch.setattr(GRPOTrainer, "_compute_loss", lambda self, model, inputs: torch.zeros((), requires_grad=True))
    with pytest.raises(
        RuntimeError, match=r"broke fact S2 .*the loss never ran self._get_per_token_logps_and_entropies"
    ):
        trainer.train()
    assert trainer.state.global_step == 0


# ------------------------------------------------------------------------------------------------------ R1
def test_rloo_computes_pi_old_with_its_first_log_prob_forward_and_keeps_only_its_masked_sum(
    tiny_model_path, tmp_path, monkeypatch
):
    trainer = grpo_trainer(tiny_model_path, tmp_path, "rloo", beta=0.1, max_completion_length=COMPLETION_LENGTH)
    assert trainer.ref_model is not None
    forwards = []
    forward = RLOOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, *args, **kwargs):
        logps, entropies, aux_loss = forward(self, model, *args, **kwargs)
        forwards.append((model, torch.is_grad_enabled(), logps))
        return logps, entropies, aux_loss

    monkeypatch.setattr(RLOOTrainer, "_get_per_token_logps_and_entropies", spy)
    trainer.model.train()
    output = trainer._generate_and_score_completions([{"prompt": "p0"}, {"prompt": "p0"}])
    assert [(model is trainer.model, grad) for model, grad, _ in forwards] == [(True, False), (False, False)]
    pi_old = forwards[0][2]
    assert torch.equal((pi_old * output["completion_mask"]).sum(1), output["old_logps"])
    assert "old_per_token_logps" not in output, "RLOO drops the per-token values (trl_lopti keeps them)"


def test_lopti_rloo_stops_when_pi_old_is_no_longer_the_first_forward(tiny_model_path, tmp_path, monkeypatch):
    """The runtime check of fact R1, at every generation batch."""
    trainer = LoptiRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=reward,
        args=LoptiRLOOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to="none", use_cpu=True
        ),
        train_dataset=Dataset.from_dict({"prompt": ["p"] * 4}),
    )
    generate = RLOOTrainer._generate_and_score_completions

    def generate_with_another_pi_old(self, inputs):  # a TRL whose old_logps is not its first forward's masked sum
        output = generate(self, inputs)
        output["old_logps"] = output["old_logps"] + 1.0
        return output

    monkeypatch.setattr(RLOOTrainer, "_generate_and_score_completions", generate_with_another_pi_old)
    trainer.model.train()
    with pytest.raises(RuntimeError, match="broke fact R1 of trl_lopti"):
        trainer._generate_and_score_completions([{"prompt": "p"}, {"prompt": "p"}])


# ------------------------------------------------------------------------------------------------------ S2, R2
def test_rloo_loss_runs_one_policy_forward_sums_it_and_reads_old_logps_and_advantages_after_it(
    tiny_model_path, tmp_path, monkeypatch
):
    trainer = grpo_trainer(tiny_model_path, tmp_path, "rloo", beta=0.0)
    batch, _ = fixed_generation_batch(tiny_model_path, 2, seed=0, beta=0.0)
    batch["old_logps"] = torch.tensor([-20.0, -25.0])
    events, policy_logps = [], []
    forward = RLOOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, *args, **kwargs):
        events.append(("forward", "policy" if model is trainer.model else "other"))
        logps, entropies, aux_loss = forward(self, model, *args, **kwargs)
        policy_logps.append(logps.detach())
        return logps, entropies, aux_loss

    monkeypatch.setattr(RLOOTrainer, "_get_per_token_logps_and_entropies", spy)
    trainer.model.train()
    for accumulation in (1, 4):  # RLOO's loss is not divided by the gradient accumulation (the Trainer divides it)
        trainer.current_gradient_accumulation_steps = accumulation
        events.clear()
        loss = trainer.compute_loss(trainer.model, ReadRecorder(batch, events))
        assert events.count(("forward", "policy")) == 1 and ("forward", "other") not in events
        forward_at = events.index(("forward", "policy"))
        for key in ("advantages", "old_logps"):
            reads = [i for i, event in enumerate(events) if event == ("read", key)]
            assert reads and min(reads) > forward_at, f"{key} is read before the policy forward: {events}"
        ratio = torch.exp((policy_logps[-1] * batch["completion_mask"]).sum(1) - batch["old_logps"])
        advantages = batch["advantages"]
        epsilon_low, epsilon_high = trainer.args.epsilon, trainer.args.epsilon_high or trainer.args.epsilon
        expected = -torch.min(ratio * advantages, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages).mean()
        torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------ S2 (its output)
@pytest.mark.parametrize("trl_trainer", list(TRL_TRAINERS))
def test_the_log_prob_forward_returns_logps_entropies_and_aux_loss(tiny_model_path, tmp_path, trl_trainer):
    """TRL's own forward, as its loss calls it: (log-probabilities (B, T) with gradient, entropies, auxiliary loss)."""
    trainer = grpo_trainer(tiny_model_path, tmp_path, trl_trainer)
    batch, _ = fixed_generation_batch(tiny_model_path, 2, seed=0, beta=0.0)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    trainer.model.train()
    output = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, COMPLETION_LENGTH, compute_entropy=True
    )
    assert isinstance(output, tuple) and len(output) == 3
    logps, entropies, aux_loss = output
    assert logps.shape == entropies.shape == (2, COMPLETION_LENGTH) and logps.requires_grad and aux_loss is None


# ------------------------------------------------------------------------------------------------------ S2 (arguments)
@pytest.mark.parametrize("trl_trainer", list(TRL_TRAINERS))
def test_the_log_prob_forward_names_the_multimodal_inputs_trl_lopti_passes(trl_trainer):
    """trl_lopti passes a batch's multimodal inputs (`extra_forward_keys()`) to TRL's log-prob forward by name. TRL 1.14's
    `GRPOTrainer._get_per_token_logps_and_entropies` takes them as `**kwargs` and passes them on to
    `_full_logits_logps`; every other release names them in the method itself."""
    import inspect

    from trl_lopti.utils import extra_forward_keys

    trainer_class, _ = TRL_TRAINERS[trl_trainer]
    forward = trainer_class._get_per_token_logps_and_entropies
    named = inspect.signature(forward).parameters
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in named.values()):
        named = inspect.signature(trainer_class._full_logits_logps).parameters
    assert {"pixel_values", "image_grid_thw"} <= set(extra_forward_keys()) <= set(named)
    assert "batch_size" in named and "batch_size" not in extra_forward_keys()


# ------------------------------------------------------------------------------------------------------ G2
@pytest.mark.parametrize("steps_per_generation", [1, 2], ids=["on-policy", "off-policy"])
def test_grpo_returns_pi_old_exactly_off_policy_and_logs_the_batch_advantages(
    tiny_model_path, tmp_path, steps_per_generation
):
    trainer = grpo_trainer(
        tiny_model_path, tmp_path, steps_per_generation=steps_per_generation, gradient_accumulation_steps=1
    )
    trainer.model.train()
    output = trainer._generate_and_score_completions([{"prompt": "p0"}] * 2 * steps_per_generation)
    off_policy = steps_per_generation > 1  # gradient_accumulation_steps % (steps_per_generation * num_iterations)
    assert ("old_per_token_logps" in output) == off_policy  # G2
    # The completions table's advantages, which REINFORCE++ replaces by its own (no fact: only the table shows them).
    assert list(trainer._logs["advantages"])[-len(output["advantages"]) :] == output["advantages"].tolist()


# ------------------------------------------------------------------------------------------------------ S3
@pytest.mark.parametrize("trl_trainer", list(TRL_TRAINERS))
def test_checkpoint_hooks_save_at_each_checkpoint_and_load_after_the_state(tiny_model_path, tmp_path, trl_trainer):
    calls = []
    trainer_class, _ = TRL_TRAINERS[trl_trainer]

    class Recorder(trainer_class):
        def _save_checkpoint(self, model, trial):
            calls.append(("save", self.state.global_step))
            super()._save_checkpoint(model, trial)

        def _load_optimizer_and_scheduler(self, checkpoint):
            calls.append(("load", self.state.global_step, checkpoint is not None))
            super()._load_optimizer_and_scheduler(checkpoint)

    trainer = grpo_trainer(tiny_model_path, tmp_path, trl_trainer, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.__class__ = Recorder
    trainer.train()
    assert [call for call in calls if call[0] == "save"] == [("save", 1), ("save", 2)]
    calls.clear()
    resumed = grpo_trainer(tiny_model_path, tmp_path / "resumed", trl_trainer, max_steps=2)
    resumed.__class__ = Recorder
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert ("load", 1, True) in calls, "called on resume, after the state (global_step 1) is loaded"


# ------------------------------------------------------------------------------------------------------ S4
GRPO_LOSS_TYPES = ["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize(
    "trl_trainer, options",
    [
        *[
            ("grpo", dict(loss_type=loss, importance_sampling_level=level))
            for loss in GRPO_LOSS_TYPES
            for level in ("token", "sequence")
        ],
        ("rloo", {}),
    ],
    ids=lambda value: value if isinstance(value, str) else "-".join(map(str, value.values())),
)
def test_every_loss_counts_a_token_only_under_its_completion_mask(
    tiny_model_path, tmp_path, monkeypatch, trl_trainer, options
):
    """TRL's own loss, at parameters away from pi_old and pi_ref (ratios, clipping, KL): the gradient w.r.t. the
    log-probability of every padded token is exactly zero, and not of the others."""
    trainer_class, _ = TRL_TRAINERS[trl_trainer]
    trainer = grpo_trainer(tiny_model_path, tmp_path, trl_trainer, beta=0.1, **options)
    batch, _ = fixed_generation_batch(tiny_model_path, 2, seed=3, beta=0.1)  # row 0 padded after 3 tokens
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        batch["old_per_token_logps"] = batch["ref_per_token_logps"] + 0.3 * torch.randn(
            batch["ref_per_token_logps"].shape, generator=generator
        )
    batch["old_logps"] = (batch["old_per_token_logps"] * batch["completion_mask"]).sum(1)  # RLOO's
    returned = []
    forward = trainer_class._get_per_token_logps_and_entropies

    def retained(self, *args, **kwargs):
        logps, entropies, aux_loss = forward(self, *args, **kwargs)
        if logps.requires_grad:
            logps.retain_grad()
            returned.append(logps)
        return logps, entropies, aux_loss

    monkeypatch.setattr(trainer_class, "_get_per_token_logps_and_entropies", retained)
    trainer.model.train()
    trainer.compute_loss(trainer.model, dict(batch)).backward()
    mask = batch["completion_mask"].bool()
    assert (~mask).any() and torch.count_nonzero(returned[0].grad[~mask]) == 0
    assert torch.count_nonzero(returned[0].grad[mask]) > 0
