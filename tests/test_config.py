"""LoptiGRPOConfig: defaults, validation at construction, the Lopti schedule constraint."""

import pytest
from trl import GRPOConfig

from trl_lopti import LoptiGRPOConfig


def make(**fields):
    return LoptiGRPOConfig(output_dir="unused", report_to="none", use_cpu=True, **fields)


def test_defaults_are_the_papers_and_extend_grpo_config():
    config = make()
    assert isinstance(config, GRPOConfig)
    assert (config.advantage_reweighting_alpha, config.lopti_threshold, config.lopti_order) == (0.3, 0.5, "low_first")
    assert config.lopti_enabled and config.advantage_reweighting_enabled


@pytest.mark.parametrize("alpha", [-0.1, 1.01, float("nan"), "high", True])
def test_alpha_out_of_range_names_the_field_and_range(alpha):
    with pytest.raises(ValueError, match=r"advantage_reweighting_alpha must be a number in \[0, 1\]"):
        make(advantage_reweighting_alpha=alpha)


@pytest.mark.parametrize("eta", [0.0, 1.0, -0.5, 2.0, "half", float("nan")])
def test_threshold_out_of_range_names_the_field_and_range(eta):
    with pytest.raises(ValueError, match=r"lopti_threshold must be a number in the open interval \(0, 1\)"):
        make(lopti_threshold=eta)


@pytest.mark.parametrize("disabled", [None, "None", "null"])
def test_none_disables_lopti(disabled):
    config = make(lopti_threshold=disabled, advantage_reweighting_alpha=0)
    assert config.lopti_threshold is None and not config.lopti_enabled
    assert config.advantage_reweighting_alpha == 0.0 and not config.advantage_reweighting_enabled


def test_unknown_order_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"lopti_order must be one of \['high_first', 'low_first'\]"):
        make(lopti_order="random")


def test_every_lopti_pass_must_end_on_an_optimizer_step():
    with pytest.raises(ValueError, match="steps_per_generation \\* num_iterations"):
        make(gradient_accumulation_steps=4, steps_per_generation=2)
    # fine without Lopti, and fine when the pass spans whole optimizer steps
    make(gradient_accumulation_steps=4, steps_per_generation=2, lopti_threshold=None)
    make(gradient_accumulation_steps=2, steps_per_generation=4)
    make(gradient_accumulation_steps=4, steps_per_generation=2, num_iterations=2)


def test_fields_have_help_for_the_cli():
    from dataclasses import fields

    helps = {f.name: f.metadata.get("help", "") for f in fields(LoptiGRPOConfig)}
    for name in ("advantage_reweighting_alpha", "lopti_threshold", "lopti_order"):
        assert helps[name]
