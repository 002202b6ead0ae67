"""LoptiGRPOConfig: defaults, validation at construction, the Lopti schedule constraint, the GRPOConfig upgrade."""

import warnings
from dataclasses import fields

import numpy as np
import pytest
from trl import GRPOConfig

from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer
from trl_lopti.config import as_lopti_config


def make(**values):
    return LoptiGRPOConfig(output_dir="unused", report_to="none", use_cpu=True, **values)


def rejection(**values) -> str:
    """The message of the `ValueError` the config raises for `values`."""
    with pytest.raises(ValueError) as error:
        make(**values)
    return str(error.value)


def test_defaults_are_the_papers_and_extend_grpo_config():
    config = make()
    assert isinstance(config, GRPOConfig)
    assert (config.advantage_reweighting_alpha, config.lopti_threshold, config.lopti_order) == (0.3, 0.5, "low_first")
    assert config.advantage_estimator == "grpo"
    assert config.lopti_enabled and config.advantage_reweighting_enabled
    assert config.lopti_quantile is None


@pytest.mark.parametrize("quantile", [0.0, 1.0, -0.2, 1.5, "0.3", float("nan"), True, [0.3]])
def test_quantile_out_of_range_names_the_field_and_range(quantile):
    message = rejection(lopti_quantile=quantile)
    assert "lopti_quantile" in message and "(0, 1)" in message and repr(quantile) in message


@pytest.mark.parametrize("threshold", ["default", None])  # the default eta, or none: the quantile replaces it
@pytest.mark.parametrize("quantile", [0.2, np.float32(0.5)])
def test_a_quantile_alone_turns_lopti_on_with_two_passes(threshold, quantile):
    fields = {} if threshold == "default" else {"lopti_threshold": threshold}
    config = make(lopti_quantile=quantile, advantage_reweighting_alpha=0.0, **fields)
    assert config.lopti_quantile == pytest.approx(float(quantile)) and type(config.lopti_quantile) is float
    assert config.lopti_threshold is None, "one split rule: the quantile"
    assert config.lopti_enabled and config.lopti_num_passes == 2 and config.lopti_pass_order == ("low", "high")


@pytest.mark.parametrize("threshold", [0.4, 0.5, np.float64(0.5)])
def test_a_fixed_eta_given_beside_a_quantile_is_rejected_even_the_defaults_value(threshold):
    message = rejection(lopti_threshold=threshold, lopti_quantile=0.3)
    assert message.startswith(f"lopti_threshold={threshold!r} and lopti_quantile=0.3 are two Lopti split rules")


def test_the_lopti_schedule_check_applies_to_the_quantile_rule():
    message = rejection(lopti_quantile=0.3, gradient_accumulation_steps=4, steps_per_generation=2)
    assert "gradient_accumulation_steps (4)" in message and "lopti_quantile=None" in message


@pytest.mark.parametrize("alpha", [-0.1, 1.01, float("nan"), "0.3", True, None, [0.3]])
def test_alpha_out_of_range_names_the_field_and_range(alpha):
    message = rejection(advantage_reweighting_alpha=alpha)
    assert "advantage_reweighting_alpha" in message and "[0, 1]" in message and repr(alpha) in message


@pytest.mark.parametrize("eta", [0.0, 1.0, -0.5, 2.0, "half", float("nan"), np.float32(1.0), True])
def test_threshold_out_of_range_names_the_field_and_range(eta):
    message = rejection(lopti_threshold=eta)
    assert "lopti_threshold" in message and "(0, 1)" in message and repr(eta) in message


@pytest.mark.parametrize(
    "alpha, eta, expected",
    [
        (np.int64(0), np.float32(0.5), (0.0, 0.5)),  # numpy scalars, as from a sweep
        (np.float64(0.25), np.float16(0.375), (0.25, 0.375)),
        (1, 0.4, (1.0, 0.4)),
    ],
)
def test_any_real_number_is_accepted_and_stored_as_float(alpha, eta, expected):
    config = make(advantage_reweighting_alpha=alpha, lopti_threshold=eta)
    assert (config.advantage_reweighting_alpha, config.lopti_threshold) == pytest.approx(expected)
    assert type(config.advantage_reweighting_alpha) is float and type(config.lopti_threshold) is float


def test_text_is_not_a_number_for_the_dataclass():
    """Text belongs to the command line (its parser reads numbers and None); the dataclass refuses it."""
    message = rejection(lopti_threshold="0.5")
    assert "lopti_threshold" in message and "'0.5'" in message


def test_none_disables_lopti():
    config = make(lopti_threshold=None, advantage_reweighting_alpha=0)
    assert config.lopti_threshold is None and not config.lopti_enabled
    assert config.advantage_reweighting_alpha == 0.0 and not config.advantage_reweighting_enabled


def test_unknown_order_and_estimator_name_the_allowed_values():
    message = rejection(lopti_order="random")
    assert all(text in message for text in ("lopti_order", "'random'", "'high_first'", "'low_first'"))
    message = rejection(advantage_estimator="ppo")
    assert all(text in message for text in ("advantage_estimator", "'ppo'", "'grpo'", "'reinforce_plus_plus'"))
    assert make(advantage_estimator="reinforce_plus_plus").advantage_estimator == "reinforce_plus_plus"
    message = rejection(advantage_estimator="reinforce_plus_plus", multi_objective_aggregation="normalize_then_sum")
    assert all(
        text in message for text in ("multi_objective_aggregation", "'normalize_then_sum'", "sum_then_normalize")
    )


@pytest.mark.parametrize(
    "accumulation, steps, iterations",
    [(4, 2, 1), (2, 3, 1), (4, 3, 2), (6, 4, 1)],
)
def test_every_lopti_pass_must_end_on_an_optimizer_step_and_the_error_gives_a_fix_that_works(
    accumulation, steps, iterations
):
    message = rejection(
        gradient_accumulation_steps=accumulation, steps_per_generation=steps, num_iterations=iterations
    )
    assert f"steps_per_generation * num_iterations ({steps} * {iterations} " in message
    assert f"gradient_accumulation_steps ({accumulation})" in message and "lopti_threshold=None" in message
    # the fix it names: the next steps_per_generation whose passes end on an optimizer step
    fitting = next(n for n in range(steps + 1, 100) if n * iterations % accumulation == 0)
    assert f"steps_per_generation={fitting}" in message
    config = make(gradient_accumulation_steps=accumulation, steps_per_generation=fitting, num_iterations=iterations)
    assert config.lopti_enabled and config.steps_per_generation == fitting
    # fine without Lopti
    make(
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps,
        num_iterations=iterations,
        lopti_threshold=None,
    )


def test_a_plain_grpo_config_is_upgraded_with_a_visible_warning():
    plain = GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, learning_rate=3e-6, max_steps=7)
    with pytest.warns(UserWarning, match=r"plain GRPOConfig") as caught:
        upgraded = as_lopti_config(plain, model="some/model", trainer_class=LoptiGRPOTrainer)
    message = str(caught[0].message)
    for text in ("advantage_reweighting_alpha=0.3", "lopti_threshold=0.5", "max_steps"):
        assert text in message
    assert isinstance(upgraded, LoptiGRPOConfig)
    assert (upgraded.learning_rate, upgraded.max_steps) == (3e-6, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a LoptiGRPOConfig passes through silently
        assert as_lopti_config(upgraded, model="some/model", trainer_class=LoptiGRPOTrainer) is upgraded


def test_a_plain_grpo_config_with_an_unfit_schedule_gets_an_error_in_its_own_terms():
    plain = GRPOConfig(
        output_dir="unused", report_to="none", use_cpu=True, steps_per_generation=3, gradient_accumulation_steps=2
    )
    with pytest.raises(ValueError, match="plain GRPOConfig") as error:
        as_lopti_config(plain, model="some/model", trainer_class=LoptiGRPOTrainer)
    message = str(error.value)
    assert "steps_per_generation=4" in message and "lopti_threshold=None" in message
    # one piece of advice, in terms of what a plain GRPOConfig user can pass
    assert (
        message.count("to train without Lopti") == 1
        and "pass a trl_lopti.LoptiGRPOConfig with lopti_threshold=None" in message
    )
    assert "lopti_quantile" not in message


def test_fields_have_help_for_the_cli():
    helps = {f.name: f.metadata.get("help", "") for f in fields(LoptiGRPOConfig)}
    for name in (
        "advantage_reweighting_alpha",
        "lopti_threshold",
        "lopti_quantile",
        "lopti_order",
        "advantage_estimator",
    ):
        assert helps[name]


@pytest.mark.parametrize(
    "fields, nearest",
    [
        (dict(max_steps=5), "Set max_steps=4 or max_steps=6."),  # 2 optimizer steps per generation batch
        (dict(max_steps=1), "Set max_steps=2."),
        (dict(max_steps=6, gradient_accumulation_steps=1, steps_per_generation=2), "Set max_steps=4 or max_steps=8."),
    ],
)
def test_a_max_steps_inside_a_cycle_warns_at_construction_with_the_nearest_that_is_not(fields, nearest):
    with pytest.warns(UserWarning, match="ends inside a generation batch's Lopti cycle") as caught:
        make(**fields)
    [message] = [str(warning.message) for warning in caught if "Lopti cycle" in str(warning.message)]
    assert f"max_steps={fields['max_steps']}" in message and message.endswith(nearest)
    assert "would train its low pass only" in message


@pytest.mark.parametrize(
    "fields", [dict(max_steps=4), dict(max_steps=3, lopti_threshold=None), dict(max_steps=-1), dict(max_steps=8)]
)
def test_a_max_steps_on_a_cycle_boundary_or_without_lopti_is_silent(fields):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        make(**fields)


def test_ar_refuses_a_kl_term_with_a_sequence_level_ratio_naming_the_fields():
    message = rejection(importance_sampling_level="sequence", beta=0.04)
    for text in ("advantage_reweighting_alpha=0.3", "importance_sampling_level='sequence'", "beta=0.04"):
        assert text in message
    assert "Set beta=0.0, advantage_reweighting_alpha=0.0, or importance_sampling_level='token'" in message
    make(importance_sampling_level="sequence", beta=0.0)  # AR's general form
    make(importance_sampling_level="sequence", beta=0.04, advantage_reweighting_alpha=0.0)  # GSPO with KL, Lopti alone
    make(importance_sampling_level="token", beta=0.04)
