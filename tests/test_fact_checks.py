"""The runtime checks of the TRL facts (`trl_lopti.trl_contract.TRL_FACTS`), each proven by a TRL broken on purpose.

Every check runs in every real training run. Here TRL is made to behave as a plausible future release that breaks one
fact (`testing_utils.TRL_MUTATIONS`), and a short real training run of the Lopti trainer must stop with that fact's
number; the same run with TRL as it is trains to the end (the control). A TRL that changes only what the logs and the
completions table show (`testing_utils.NO_WRONG_UPDATE_MUTATIONS`) never stops a run: no update is wrong. A sampler
that would leave prompts untrained stops it, but in a run resumed with `ignore_data_skip=True`.
"""

import warnings

import pytest
from testing_utils import NO_WRONG_UPDATE_MUTATIONS, TRL_MUTATIONS, conversational_dataset, length_reward, small_config
from trl import GRPOTrainer, RLOOTrainer

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer, LoptiRLOOConfig, LoptiRLOOTrainer
from trl_lopti.trl_contract import TRL_FACTS, TRL_VERSION


TRAINERS = {
    "grpo": (LoptiGRPOTrainer, LoptiGRPOConfig, GRPOTrainer),
    "rloo": (LoptiRLOOTrainer, LoptiRLOOConfig, RLOOTrainer),
}


def run(trainer_name: str, model_path: str, output_dir, resume_from_checkpoint=None, **overrides):
    """Trains one Lopti cycle: one generation batch, 4 optimizer steps (2 per pass), TRL computing pi_old."""
    trainer_class, config_class, _ = TRAINERS[trainer_name]
    values = dict(per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=1, seed=42)
    values |= dict(steps_per_generation=2, max_completion_length=4, learning_rate=1e-3, bf16=False)
    values |= dict(advantage_reweighting_alpha=0.3, lopti_threshold=0.5)
    args = small_config(output_dir, config_class, **values | overrides)
    trainer = trainer_class(  # distinct prompts: the dataloader's batches differ
        model=model_path, reward_funcs=length_reward, args=args, train_dataset=conversational_dataset()
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def mutations_for(trainer_name: str) -> list[str]:
    """The mutations of the facts a training run of `trainer_name` checks (`trl-lopti check` alone finds the others:
    tests/test_check.py)."""
    other = "R" if trainer_name == "grpo" else "G"  # the S facts hold for both trainers
    checked = {fact.code for fact in TRL_FACTS if fact.checked_while_training}
    return [name for name, (fact, _) in TRL_MUTATIONS.items() if not fact.startswith(other) and fact in checked]


# what a mutation needs of the run to show: a second pass, a second log of a batch, a checkpoint inside a cycle...
RUN_SETTINGS = {
    "a loss that counts padding": {"mask_truncated_completions": True},  # every completion truncated: all masked
    "no pi_old off-policy": {},  # steps_per_generation 2 over 1 accumulation step: off-policy
    "rewards from another method": {"advantage_estimator": "reinforce_plus_plus"},
}
RESUMED = {"state loaded after the hook", "hook not called on resume"}


CONTROL_SETTINGS = [{}, *({tuple(values.items()): values for values in RUN_SETTINGS.values() if values}.values())]


@pytest.mark.parametrize(
    "trainer_name, settings",
    [  # REINFORCE++ is LoptiGRPOConfig's
        (name, settings)
        for name in TRAINERS
        for settings in CONTROL_SETTINGS
        if name == "grpo" or len(settings) != 1 or "advantage_estimator" not in settings
    ],
    ids=lambda value: value if isinstance(value, str) else "-".join(value) or "default",
)
def test_the_control_run_trains_every_step_with_every_check_on(tiny_model_path, tmp_path, trainer_name, settings):
    """TRL as it is, with each mutation's run settings: every check passes, and a resume inside the cycle too."""
    trainer = run(trainer_name, tiny_model_path, tmp_path / "whole", save_strategy="steps", save_steps=1, **settings)
    assert trainer.state.global_step == 4
    checkpoint = str(tmp_path / "whole" / "checkpoint-1")
    resumed = run(trainer_name, tiny_model_path, tmp_path / "resumed", checkpoint, **settings)
    assert resumed.state.global_step == 4


@pytest.mark.parametrize(
    "trainer_name, mutation",
    [(trainer_name, mutation) for trainer_name in TRAINERS for mutation in mutations_for(trainer_name)],
)
def test_a_broken_trl_fact_stops_training_with_its_number(
    tiny_model_path, tmp_path, monkeypatch, trainer_name, mutation
):
    fact, mutate = TRL_MUTATIONS[mutation]
    settings = RUN_SETTINGS.get(mutation, {})
    if mutation in RESUMED:  # a checkpoint inside the cycle (after its first optimizer step), taken by unbroken TRL
        run(trainer_name, tiny_model_path, tmp_path / "whole", save_strategy="steps", save_steps=1, **settings)
        settings = dict(settings, resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-1"))
    mutate(monkeypatch, TRAINERS[trainer_name][2])
    with pytest.raises(RuntimeError, match=rf"broke fact {fact} of trl_lopti \(") as error:
        run(trainer_name, tiny_model_path, tmp_path / "broken", **settings)
    print(f"{trainer_name}, {mutation}: {error.value}")  # noqa: T201 - what a user sees (pytest -s)


@pytest.mark.parametrize("mutation", list(NO_WRONG_UPDATE_MUTATIONS))
def test_what_leaves_every_update_the_methods_never_stops_a_run(tiny_model_path, tmp_path, monkeypatch, mutation):
    NO_WRONG_UPDATE_MUTATIONS[mutation](monkeypatch, GRPOTrainer)
    settings = {"advantage_estimator": "reinforce_plus_plus", "max_steps": 8}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = run("grpo", tiny_model_path, tmp_path, **settings)
    assert trainer.state.global_step == 8
    messages = [str(w.message) for w in caught]
    # A table that no longer shows the advantages trained on is worth a warning.
    table = [m for m in messages if "REINFORCE++: TRL's completions table" in m]
    assert bool(table) == (mutation == "advantages not logged"), table


def test_a_sampler_that_would_leave_prompts_untrained_stops_the_run_saying_which(
    tiny_model_path, tmp_path, monkeypatch
):
    """TRL's sampler repeating each generation batch by the config's num_iterations (once, not once per pass): the
    second pass would be served the next batch's prompts, which TRL never generates from."""
    TRL_MUTATIONS["sampler repeats by the config's num_iterations"][1](monkeypatch, GRPOTrainer)
    with pytest.raises(RuntimeError) as error:
        run("grpo", tiny_model_path, tmp_path, max_steps=8)
    message = str(error.value)
    print(message)  # noqa: T201 - the refusal, word for word (pytest -s)
    expected = f"TRL {TRL_VERSION} broke fact S1 of trl_lopti (Schedule): at micro-step 2 of a Lopti cycle"
    assert message.startswith(expected)
    assert "the prompts served from micro-step 2 to the cycle's end would never be trained" in message
    assert "(4 prompts, the first " in message and "Count to" in message
    # Nothing to install: the installed TRL is a tested release, changed at run time.
    assert "pip install" not in message and "GRPOTrainer._get_train_sampler" in message


def test_a_run_resumed_with_ignore_data_skip_warns_of_untrained_prompts_and_trains_on(tiny_model_path, tmp_path):
    """Resuming inside a cycle without skipping the data seen serves other prompts inside a later cycle: the one
    case where that is expected, so a warning, for the rest of the run."""
    run("grpo", tiny_model_path, tmp_path / "whole", save_strategy="steps", save_steps=1, max_steps=8)
    checkpoint = str(tmp_path / "whole" / "checkpoint-1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = run("grpo", tiny_model_path, tmp_path / "resumed", checkpoint, max_steps=8, ignore_data_skip=True)
    assert resumed.state.global_step == 8
    untrained = [str(w.message) for w in caught if "as it does after resuming with ignore_data_skip=True" in str(w)]
    assert len(untrained) == 1, untrained
