"""AR and Lopti on the GRPO family: TRL's `GMPOTrainer` and a user's own `GRPOTrainer` subclass, composed as a user
writes it (`class LoptiGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer)`, `@dataclass class LoptiGMPOConfig(LoptiGRPOConfig,
GMPOConfig)`).

The config keeps each base's own defaults; trained parameters equal a hand-run of the general forms on an independent
loss written from its formulas; the two passes add up to the base's own update on every parameter; what cannot be
exact is refused in words that name the user's class; `trl-lopti check --trainer_class` proves a composition and
finds a loss that bypasses TRL's log-prob forward.
"""

import copy
import dataclasses
import os
import pickle
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from testing_utils import (
    COMPLETION_LENGTH,
    FLOAT64,
    PLAIN_SGD,
    TEMPERATURE,
    anchor_metric_trainer,
    completion_logps,
    conversational_dataset,
    fixed_generation,
    length_reward,
    micro_batches_as_generated,
    perturbed_model,
    quantile_generation_batch,
    small_config,
    threshold_between_values,
    use_exact_log_prob_head,
)
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer, RLOOTrainer

from trl_lopti import LoptiArguments, LoptiGRPOConfig, LoptiGRPOTrainer, LoptiRLOOTrainer
from trl_lopti.check import check_trainer_class, main
from trl_lopti.config import as_lopti_config
from trl_lopti.trl_contract import TRL_VERSION


gmpo = pytest.importorskip("trl.experimental.gmpo", reason="GMPOTrainer is in TRL from 1.16.0")


@dataclass
class LoptiGMPOConfig(LoptiArguments, gmpo.GMPOConfig): ...


class LoptiGMPOTrainer(LoptiGRPOTrainer, gmpo.GMPOTrainer): ...


class SequenceRatioTrainer(GRPOTrainer):
    """A user's objective, as researchers write them: one importance ratio per sequence (the exp of its mean log-ratio)
    times the sequence's advantage, read as (B,). It records the shape of the advantages it read."""

    advantage_shapes: list

    def _compute_loss(self, model, inputs):
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits_to_keep = inputs["completion_ids"].size(1)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep)
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps
        mask = inputs["completion_mask"]
        log_ratio = ((logps - old_logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        advantages = inputs["advantages"]
        self.advantage_shapes.append(tuple(advantages.shape))
        loss = -(torch.exp(log_ratio) * advantages).mean()
        return loss / self.current_gradient_accumulation_steps


class LoptiSequenceRatioTrainer(LoptiGRPOTrainer, SequenceRatioTrainer): ...


class ClippedRLOOTrainer(RLOOTrainer):
    """A user's RLOO variant (RLOO's loss, a name of its own)."""

    _tag_names: ClassVar[list[str]] = ["trl", "clipped-rloo"]


class LoptiClippedRLOOTrainer(LoptiRLOOTrainer, ClippedRLOOTrainer): ...


class OwnLogitsTrainer(GRPOTrainer):
    """A user's loss that computes the log-probabilities from the logits itself, never through TRL's forward."""

    def _compute_loss(self, model, inputs):
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        logits = model(input_ids=input_ids).logits[:, -inputs["completion_ids"].size(1) - 1 : -1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
        mask = inputs["completion_mask"]
        return -((logps * mask).sum(-1) * inputs["advantages"]).mean()


class LoptiOwnLogitsTrainer(LoptiGRPOTrainer, OwnLogitsTrainer): ...


class TwiceForwardTrainer(GRPOTrainer):
    """A user's loss that takes the log-probabilities from a first forward and the entropies from a second, and adds
    an entropy bonus: every term goes through TRL's forward."""

    def _compute_loss(self, model, inputs):
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits_to_keep = inputs["completion_ids"].size(1)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep)
        _, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, compute_entropy=True
        )
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps
        mask = inputs["completion_mask"]
        ratio = torch.exp(logps - old_logps)
        per_token = -ratio * inputs["advantages"].unsqueeze(1) - 0.01 * entropies
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        return loss / self.current_gradient_accumulation_steps


class LoptiTwiceForwardTrainer(LoptiGRPOTrainer, TwiceForwardTrainer): ...


class NegativeLogLikelihoodTrainer(GRPOTrainer):
    """GRPO's loss plus an SFT-like term computed from the logits: a loss that bypasses TRL's forward in part."""

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        logits = model(input_ids=input_ids).logits[:, -inputs["completion_ids"].size(1) - 1 : -1]
        targets = inputs["completion_ids"].flatten()
        return loss + 0.1 * torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets)


class LoptiNegativeLogLikelihoodTrainer(LoptiGRPOTrainer, NegativeLogLikelihoodTrainer): ...


# ------------------------------------------------------------------------------------------------ the config
def test_a_config_composed_of_lopti_arguments_keeps_each_bases_defaults_and_help():
    config = LoptiGMPOConfig(output_dir="unused", use_cpu=True, report_to="none")
    gmpo_field = gmpo.GMPOConfig.__dataclass_fields__["epsilon"]
    assert config.epsilon == gmpo_field.default == 0.4
    assert LoptiGMPOConfig.__dataclass_fields__["epsilon"].metadata["help"] == gmpo_field.metadata["help"]
    assert (config.advantage_reweighting_alpha, config.lopti_threshold) == (0.3, 0.5)
    names = [f.name for f in dataclasses.fields(LoptiGMPOConfig)]
    gmpo_names = [f.name for f in dataclasses.fields(gmpo.GMPOConfig)]
    assert [name for name in names if name in gmpo_names] == gmpo_names
    # A user's own value wins: in the call, and in the class.
    assert LoptiGMPOConfig(output_dir="unused", use_cpu=True, epsilon=0.3).epsilon == 0.3

    @dataclass
    class NarrowGMPOConfig(LoptiArguments, gmpo.GMPOConfig):
        epsilon: float = 0.25

    assert NarrowGMPOConfig(output_dir="unused", use_cpu=True).epsilon == 0.25


def test_a_lopti_config_composed_with_another_config_is_refused_where_the_class_is_written():
    """`class C(LoptiGRPOConfig, GMPOConfig)` would silently take GRPOConfig's epsilon (0.2) over GMPOConfig's own
    (0.4), since LoptiGRPOConfig inherits it: refused, with the spelling that keeps GMPO's defaults."""
    with pytest.raises(TypeError) as error:

        @dataclass
        class Mixed(LoptiGRPOConfig, gmpo.GMPOConfig): ...

    message = str(error.value)
    assert "Mixed would take the defaults of TRL's config over those its other bases declare (epsilon" in message
    assert "`@dataclass class Mixed(LoptiArguments, GMPOConfig)` (from trl_lopti import LoptiArguments)" in message


@pytest.mark.parametrize("conflicting", [False, True], ids=["no-field-conflicts", "fields-conflict"])
def test_a_composed_config_without_dataclass_is_an_error_naming_the_users_class(conflicting):
    @dataclass
    class OwnConfig(GRPOConfig):
        my_weight: float = 2.0

    other = gmpo.GMPOConfig if conflicting else OwnConfig

    class Undecorated(LoptiArguments, other):
        pass

    with pytest.raises(
        TypeError, match=rf"Undecorated composes several configs \(LoptiArguments, {other.__name__}\) "
    ):
        Undecorated(output_dir="unused", use_cpu=True)


def test_every_path_into_a_composed_trainer_gets_its_bases_defaults(monkeypatch):
    # args=None: GMPO's defaults, TRL's naming of the output folder (on a CPU, TRL's default bf16 needs a GPU).
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    default = as_lopti_config(None, "org/Tiny-Model", LoptiGMPOTrainer)
    assert isinstance(default, gmpo.GMPOConfig) and isinstance(default, LoptiArguments) and default.epsilon == 0.4
    assert default.output_dir == "Tiny-Model-Lopti-GMPO" and default.lopti_threshold == 0.5
    # A plain GMPOConfig keeps its values, a user's config its extra fields.
    plain = gmpo.GMPOConfig(output_dir="unused", use_cpu=True, epsilon=0.35, learning_rate=3e-6)
    with pytest.warns(UserWarning, match="got a plain GMPOConfig"):
        upgraded = as_lopti_config(plain, "org/Tiny-Model", LoptiGMPOTrainer)
    assert isinstance(upgraded, gmpo.GMPOConfig) and (upgraded.epsilon, upgraded.learning_rate) == (0.35, 3e-6)

    @dataclass
    class MyConfig(GRPOConfig):
        my_weight: float = 2.0

    mine = as_lopti_config(MyConfig(output_dir="unused", use_cpu=True, my_weight=5.0), "m", LoptiGRPOTrainer)
    assert isinstance(mine, MyConfig) and mine.my_weight == 5.0 and mine.advantage_reweighting_alpha == 0.3
    # The class composed at run time pickles (TRL saves the arguments with torch.save) and comes back whole.
    restored = pickle.loads(pickle.dumps(upgraded))
    assert type(restored) is type(upgraded) and restored.epsilon == 0.35 and restored.lopti_threshold == 0.5
    # A Lopti config that is not the base's: it trains with other defaults, says which, and names the config that fits.
    with pytest.warns(UserWarning, match=r"not a GMPOConfig: .* epsilon \(0\.2, not 0\.4\)") as caught:
        as_lopti_config(LoptiGRPOConfig(output_dir="unused", use_cpu=True), "m", LoptiGMPOTrainer)
    advice = "Pass a config of `@dataclass class LoptiGMPOConfig(trl_lopti.LoptiArguments, GMPOConfig)`, or args=None"
    assert any(advice in str(warning.message) for warning in caught)


def test_a_users_config_class_on_the_trainer_class_is_its_default(monkeypatch):
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)

    class ConfiguredGMPOTrainer(LoptiGMPOTrainer):
        config_class = LoptiGMPOConfig

    config = as_lopti_config(None, "org/Tiny-Model", ConfiguredGMPOTrainer)
    assert type(config) is LoptiGMPOConfig and config.epsilon == 0.4


def test_a_composed_run_names_its_base(tiny_model_path, tmp_path):
    config = small_config(tmp_path, LoptiGMPOConfig, max_steps=2)
    trainer = LoptiGMPOTrainer(tiny_model_path, length_reward, config, conversational_dataset())
    assert trainer._tag_names == ["trl", "gmpo", "lopti"]
    assert trainer._name.startswith("GMPO with Advantage Reweighting (alpha=0.3) and Low-Probability Token")
    assert "2505.12929" in trainer._paper["id"]
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "GMPO with Advantage Reweighting" in card and "lopti" in card


def test_a_config_of_a_base_trainer_class_is_the_default(monkeypatch):
    """A base trainer that names its config (`config_class`), beneath the Lopti class: its config's defaults."""
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)

    class NamedConfigTrainer(gmpo.GMPOTrainer):
        config_class = gmpo.GMPOConfig

    class LoptiNamedConfigTrainer(LoptiGRPOTrainer, NamedConfigTrainer): ...

    config = as_lopti_config(None, "org/Tiny-Model", LoptiNamedConfigTrainer)
    assert isinstance(config, gmpo.GMPOConfig) and config.epsilon == 0.4


def test_only_defaults_that_differ_and_were_kept_are_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        # epsilon set to GMPO's own value: nothing to warn about.
        as_lopti_config(LoptiGRPOConfig(output_dir="unused", use_cpu=True, epsilon=0.4), "m", LoptiGMPOTrainer)
    # A plain GRPOConfig is upgraded and warned about the same way.
    with pytest.warns(
        UserWarning, match=r"got a GRPOConfig, which is not a GMPOConfig: .* epsilon \(0\.2, not 0\.4\)"
    ):
        as_lopti_config(GRPOConfig(output_dir="unused", use_cpu=True), "m", LoptiGMPOTrainer)


def test_a_field_type_declared_as_a_string_is_resolved_in_its_own_module(tmp_path, monkeypatch):
    """A user's config module with `from __future__ import annotations`: the composed class's fields keep real types,
    so TRL's parser reads them."""
    (tmp_path / "string_configs.py").write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass, field\n"
        "from typing import Optional\n"
        "from trl import GRPOConfig\n\n\n"
        "@dataclass\n"
        "class ScaledConfig(GRPOConfig):\n"
        "    epsilon: Optional[float] = field(default=0.3, metadata={'help': 'a narrower clip'})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from string_configs import ScaledConfig
    from trl import TrlParser

    from trl_lopti.config import lopti_config_class

    composed = lopti_config_class(ScaledConfig)
    (parsed,) = TrlParser([composed]).parse_args_into_dataclasses(
        ["--output_dir", "o", "--use_cpu", "true", "--epsilon", "0.25"]
    )
    assert type(parsed) is composed and parsed.epsilon == 0.25

    @dataclass
    class LoptiScaledConfig(LoptiArguments, ScaledConfig): ...

    assert LoptiScaledConfig(output_dir="o", use_cpu=True).epsilon == 0.3
    (parsed,) = TrlParser([LoptiScaledConfig]).parse_args_into_dataclasses(
        ["--output_dir", "o", "--use_cpu", "true", "--epsilon", "0.2"]
    )
    assert parsed.epsilon == 0.2


# ------------------------------------------------------------------------------------------------ the trainer class
def test_the_other_order_of_the_bases_is_refused_when_the_class_is_written():
    with pytest.raises(
        TypeError,
        match=r"GMPOLoptiTrainer puts GMPOTrainer before LoptiGRPOTrainer .* `class "
        r"GMPOLoptiTrainer\(LoptiGRPOTrainer, GMPOTrainer\)`",
    ):

        class GMPOLoptiTrainer(gmpo.GMPOTrainer, LoptiGRPOTrainer): ...


def test_positional_arguments_reach_the_base_by_its_own_names(tiny_model_path, tmp_path):
    class ScaledTrainer(GRPOTrainer):
        def __init__(self, model, reward_funcs, args=None, train_dataset=None, reward_scale=1.0, **kwargs):
            self.reward_scale = reward_scale
            super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, **kwargs)

    class LoptiScaledTrainer(LoptiGRPOTrainer, ScaledTrainer): ...

    config = small_config(tmp_path, max_steps=2)
    trainer = LoptiScaledTrainer(tiny_model_path, length_reward, config, conversational_dataset(), 2.5)
    assert trainer.reward_scale == 2.5 and trainer.eval_dataset is None
    # Through GMPO's **kwargs, TRL's own names.
    gmpo_config = small_config(tmp_path, LoptiGMPOConfig, max_steps=2)
    trainer = LoptiGMPOTrainer(tiny_model_path, length_reward, gmpo_config, conversational_dataset(), None)
    assert len(trainer.train_dataset) == 16 and trainer.eval_dataset is None


def test_a_broken_fact_in_a_trainer_trl_lopti_does_not_test_names_that_trainer():
    from trl_lopti.trl_contract import LOSS_FORWARD, broken_fact

    composed = str(broken_fact(LOSS_FORWARD, "what it saw", LoptiGMPOTrainer))
    assert composed.startswith("GMPOTrainer._compute_loss (in trl.experimental.gmpo.gmpo_trainer) breaks fact S2")
    assert "train GMPOTrainer without trl_lopti" in composed and "pip install" not in composed
    own = str(broken_fact(LOSS_FORWARD, "what it saw", LoptiGRPOTrainer))
    assert own.startswith(f"TRL {TRL_VERSION} broke fact S2 of trl_lopti (Loss forward): what it saw.")
    assert "pip install" not in own and "changed GRPOTrainer.compute_loss or GRPOTrainer._compute_loss" in own


# ------------------------------------------------------------------------------------------------ exact, by hand
ROWS = 8
LEARNING_RATE = PLAIN_SGD["learning_rate"]


def reference_gmpo_loss(logps, old_logps, advantages, mask, epsilon_low: float, epsilon_high: float):
    """GMPO's loss from its formulas: per sequence, the geometric mean of the token ratios, each log-ratio clipped on
    the side its sequence's advantage makes harmful (above `epsilon_high` for a positive advantage, below
    `-epsilon_low` otherwise), times the advantage; the mean over sequences."""
    log_ratio = logps - old_logps
    positive = advantages[:, None] > 0
    clipped = torch.where(positive, log_ratio.clamp(max=epsilon_high), log_ratio.clamp(min=-epsilon_low))
    mean_log_ratio = (clipped * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return -(mean_log_ratio.exp() * advantages).mean()


def reference_sequence_ratio_loss(logps, old_logps, advantages, mask, epsilon_low: float, epsilon_high: float):
    """`SequenceRatioTrainer`'s loss from its formula (no clipping)."""
    mean_log_ratio = ((logps - old_logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return -(mean_log_ratio.exp() * advantages).mean()


def hand_run(initial_model, micro_batches, config, eta: float | None, alpha: float, reference_loss):
    """A generation batch trained by hand (SGD): once per Lopti group, low first (`eta` None: once, all tokens), each
    pass the whole schedule against the same pi_old, in AR's general form (the gradient through each token's
    log-probability scaled by alpha * pi_old + 1 - alpha) and the general form of isolation."""
    model = copy.deepcopy(initial_model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    with torch.no_grad():
        old = [completion_logps(model, micro_batch) for micro_batch in micro_batches]
    accumulation = config.gradient_accumulation_steps
    for group in ("low", "high") if eta is not None else (None,):
        for index, micro_batch in enumerate(micro_batches):
            mask = micro_batch["completion_mask"].bool()
            weights = alpha * old[index].exp() + 1 - alpha
            logps = completion_logps(model, micro_batch)
            logps = weights * logps + (1 - weights) * logps.detach()
            if group is not None:
                low = (old[index].exp() < eta) & mask
                active = low if group == "low" else mask & ~low
                logps = torch.where(active, logps, logps.detach())
            epsilon_high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
            loss = reference_loss(
                logps, old[index], micro_batch["advantages"], mask.double(), config.epsilon, epsilon_high
            )
            (loss / accumulation).backward()
            if (index + 1) % accumulation == 0:
                optimizer.step()
                optimizer.zero_grad()
    return model


def train_one_cycle(trainer_class, model_path, config, batch):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    trainer = trainer_class(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=config,
        train_dataset=conversational_dataset(64),
    )
    # TRL's fused head is float32 whatever the model's dtype; the hand run is not.
    use_exact_log_prob_head(trainer)
    trainer.train()
    return trainer


def cycle_config(config_class, output_dir, rows: int, eta: float | None, alpha: float, **overrides):
    """One generation batch of `rows` completions, in 2 micro-batches and 2 optimizer steps per pass (TRL computes
    pi_old at generation), plain SGD, float64; the Lopti fields where `config_class` has them."""
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=rows // 2,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_generations=2,
        max_completion_length=COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        beta=0.0,
        advantage_reweighting_alpha=alpha,
        lopti_threshold=eta,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        shuffle_dataset=False,
        max_steps=4 if eta is not None else 2,
    )
    values.update(PLAIN_SGD)
    values.update(FLOAT64)
    values.update(overrides)
    if not issubclass(config_class, LoptiArguments):
        del values["advantage_reweighting_alpha"]
        del values["lopti_threshold"]
    return config_class(**values)


def largest_difference(model_a, model_b) -> float:
    pairs = zip(model_a.parameters(), model_b.parameters(), strict=True)
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)


def batch_and_eta(model_path, rows: int):
    """A fixed generation batch with padding, a float64 copy of the model, and an eta half-way in a wide gap of the
    batch's pi_old."""
    initial_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    batch = quantile_generation_batch(initial_model.config.vocab_size, rows)
    with torch.no_grad():
        logps = completion_logps(initial_model, batch)[batch["completion_mask"].bool()]
    return initial_model, batch, float(torch.tensor(threshold_between_values(logps)).exp())


@pytest.mark.parametrize("alpha, lopti", [(0.3, False), (0.0, True), (0.3, True)], ids=["ar", "lopti", "ar-and-lopti"])
def test_gmpo_with_ar_and_lopti_trains_exactly_the_hand_run(
    tiny_float64_model_path, tmp_path, monkeypatch, single_thread, float64_norms, alpha, lopti
):
    initial_model, batch, eta = batch_and_eta(tiny_float64_model_path, ROWS)
    eta = eta if lopti else None
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", fixed_generation(batch))
    config = cycle_config(LoptiGMPOConfig, tmp_path, ROWS, eta, alpha)
    assert config.epsilon == 0.4
    trainer = train_one_cycle(LoptiGMPOTrainer, tiny_float64_model_path, config, batch)
    expected = hand_run(
        initial_model, micro_batches_as_generated(trainer, batch), config, eta, alpha, reference_gmpo_loss
    )
    difference = largest_difference(trainer.model, expected)
    moved = largest_difference(expected, initial_model)
    # 1.4e-16 measured (ar-and-lopti), moved 0.19: the parameters of the hand run.
    print(f"GMPO, alpha {alpha}, eta {eta}: |trainer - hand run| = {difference:.2e}, moved {moved:.2e}")  # noqa: T201
    assert difference < 1e-8 and moved > 1e-3
    # Without AR's and isolation's general forms the hand run lands elsewhere: the test can tell.
    plain = hand_run(initial_model, micro_batches_as_generated(trainer, batch), config, None, 0.0, reference_gmpo_loss)
    assert largest_difference(trainer.model, plain) > 1e-4


def test_a_users_loss_that_reads_one_advantage_per_sequence_gets_ars_general_form(
    tiny_float64_model_path, tmp_path, monkeypatch, single_thread, float64_norms
):
    """Micro-batches of 6 completions of 6 tokens: token-level advantages (B, T) would broadcast silently in a loss
    that reads (B,). AR takes its general form there, and Lopti isolates, exactly."""
    rows = 2 * COMPLETION_LENGTH
    initial_model, batch, eta = batch_and_eta(tiny_float64_model_path, rows)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", fixed_generation(batch))
    monkeypatch.setattr(SequenceRatioTrainer, "advantage_shapes", [], raising=False)
    config = cycle_config(LoptiGRPOConfig, tmp_path, rows, eta, 0.3)
    trainer = train_one_cycle(LoptiSequenceRatioTrainer, tiny_float64_model_path, config, batch)
    assert set(SequenceRatioTrainer.advantage_shapes) == {(rows // 2,)}, "the loss read (B,) advantages"
    micro_batches = micro_batches_as_generated(trainer, batch)
    expected = hand_run(initial_model, micro_batches, config, eta, 0.3, reference_sequence_ratio_loss)
    difference = largest_difference(trainer.model, expected)
    print(f"a user's (B,) loss: |trainer - hand run| = {difference:.2e}")  # noqa: T201
    assert difference < 1e-8 and largest_difference(expected, initial_model) > 1e-3


def test_the_passes_add_up_to_gmpos_own_update_on_every_parameter(
    tiny_float64_model_path, tmp_path, single_thread, float64_norms
):
    """At equal parameters, off-policy (ratios clip) and with GMPO's KL term: the parameter gradient of the low pass
    plus the high pass's is TRL's own GMPOTrainer's, and neither pass alone is."""
    initial_model, batch, eta = batch_and_eta(tiny_float64_model_path, ROWS)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        current = completion_logps(initial_model, batch)
    batch["old_per_token_logps"] = current + 0.4 * torch.randn(current.shape, generator=noise, dtype=torch.float64)
    batch["ref_per_token_logps"] = current + 0.3 * torch.randn(current.shape, generator=noise, dtype=torch.float64)
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    # pi_old moved: eta half-way in a wide gap of the moved probabilities.
    eta = float(
        torch.tensor(threshold_between_values(batch["old_per_token_logps"][batch["completion_mask"].bool()])).exp()
    )
    del batch["row_id"]

    def gradient(trainer, step: int) -> torch.Tensor:
        trainer.model.zero_grad(set_to_none=True)
        trainer.model.train()
        trainer._step = step
        trainer.current_gradient_accumulation_steps = 1
        trainer.compute_loss(trainer.model, dict(batch)).backward()
        return torch.cat([parameter.grad.flatten() for parameter in trainer.model.parameters()])

    common = dict(beta=0.04, max_steps=4)
    plain = gmpo.GMPOTrainer(
        model=tiny_float64_model_path,
        reward_funcs=length_reward,
        args=cycle_config(gmpo.GMPOConfig, tmp_path, ROWS, None, 0.0, **common),
        train_dataset=conversational_dataset(),
    )
    lopti = LoptiGMPOTrainer(
        model=tiny_float64_model_path,
        reward_funcs=length_reward,
        args=cycle_config(LoptiGMPOConfig, tmp_path, ROWS, eta, 0.0, **common),
        train_dataset=conversational_dataset(),
    )
    use_exact_log_prob_head(plain)
    use_exact_log_prob_head(lopti)
    whole = gradient(plain, 0)
    low = gradient(lopti, 0)
    high = gradient(lopti, lopti.args.lopti_pass_micro_steps)
    scale = float(whole.abs().max())
    difference = float((low + high - whole).abs().max()) / scale
    print(f"GMPO: |low + high - GMPOTrainer| / |GMPOTrainer| = {difference:.2e}")  # noqa: T201
    assert difference < 1e-10
    assert float((low - whole).abs().max()) / scale > 1e-3 and float((high - whole).abs().max()) / scale > 1e-3


# ------------------------------------------------------------------------------------------------ what cannot be exact
def test_ar_with_a_kl_term_in_a_loss_of_the_users_is_refused_naming_the_class_and_method(tiny_model_path, tmp_path):
    config = small_config(tmp_path, LoptiGMPOConfig, beta=0.04)
    with pytest.raises(ValueError) as error:
        LoptiGMPOTrainer(tiny_model_path, length_reward, config, conversational_dataset())
    message = str(error.value)
    assert message.startswith("LoptiGMPOTrainer: advantage_reweighting_alpha=0.3 with beta=0.04. GMPOTrainer.")
    assert "_compute_loss (in trl.experimental.gmpo.gmpo_trainer)" in message and "Set beta=0.0" in message
    # Lopti alone isolates the KL term with the rest: no refusal.
    lopti_alone = small_config(tmp_path, LoptiGMPOConfig, beta=0.04, advantage_reweighting_alpha=0.0)
    LoptiGMPOTrainer(tiny_model_path, length_reward, lopti_alone, conversational_dataset())


@pytest.mark.parametrize("anchor_rows", [None, 4], ids=["every-row", "half-the-rows"])
@pytest.mark.parametrize("lopti", [False, True], ids=["ar", "ar-and-lopti"])
def test_a_side_forward_of_another_model_in_the_users_loss_changes_nothing(
    tiny_float64_model_path, tmp_path, float64_norms, lopti, anchor_rows
):
    """A user's loss that first reads a frozen anchor model's log-probabilities through TRL's forward, without gradient
    (`testing_utils.anchor_metric_trainer`), then returns TRL's loss, on an on-policy schedule (TRL computes no pi_old
    for AR alone): the trained parameters are those of the same run without the side forward. Only a forward of the
    model the loss received, with gradient, over its rows, carries the method."""
    anchor = perturbed_model(tiny_float64_model_path, dtype=torch.float64)
    lopti_fields = {"lopti_quantile": 0.5} if lopti else {"lopti_threshold": None}
    runs = {}
    for name, trainer_class in (("plain", LoptiGRPOTrainer), ("anchor", anchor_metric_trainer(anchor, anchor_rows))):
        config = small_config(
            tmp_path / name, advantage_reweighting_alpha=0.3, max_steps=4, **lopti_fields, **PLAIN_SGD, **FLOAT64
        )
        trainer = trainer_class(tiny_float64_model_path, length_reward, config, conversational_dataset())
        use_exact_log_prob_head(trainer, anchor)
        initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        trainer.train()
        runs[name] = trainer
    moved = max(float((p.detach() - initial[n]).abs().max()) for n, p in runs["plain"].model.named_parameters())
    difference = max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(runs["anchor"].model.parameters(), runs["plain"].model.parameters(), strict=True)
    )
    rows = anchor_rows or "every"
    print(f"side forward over {rows} rows: {difference:.3g} from the run without it, moved {moved:.3g}")  # noqa: T201
    assert moved > 1e-3 and difference <= 1e-12


def test_ar_with_a_kl_term_and_a_sequence_ratio_is_refused_whatever_the_config_class(tiny_model_path, tmp_path):
    """TRL's own loss at sequence level shares one ratio per sequence: AR takes its general form, which would reweight
    the KL term's gradient. A config composed with `LoptiArguments` (which lacks LoptiGRPOConfig's own check) is refused
    by the trainer all the same."""

    @dataclass
    class LoptiMyConfig(LoptiArguments, GRPOConfig):
        my_weight: float = 1.0

    config = small_config(
        tmp_path, LoptiMyConfig, advantage_reweighting_alpha=0.3, importance_sampling_level="sequence", beta=0.04
    )
    with pytest.raises(ValueError) as error:
        LoptiGRPOTrainer(tiny_model_path, length_reward, config, conversational_dataset())
    message = str(error.value)
    assert "importance_sampling_level='sequence' gives the tokens of a sequence one importance ratio" in message
    assert "Set beta=0.0, importance_sampling_level='token', or advantage_reweighting_alpha=0.0" in message


def test_a_users_loss_that_bypasses_trls_forward_is_named_as_the_cause(tiny_model_path, tmp_path):
    config = small_config(tmp_path, advantage_reweighting_alpha=0.0, max_steps=2)
    trainer = LoptiOwnLogitsTrainer(tiny_model_path, length_reward, config, conversational_dataset())
    with pytest.raises(RuntimeError) as error:
        trainer.train()
    message = str(error.value)
    print(message)  # noqa: T201 - the error, word for word (pytest -s)
    assert message.startswith(
        "OwnLogitsTrainer._compute_loss (in test_composition) breaks fact S2 of trl_lopti (Loss forward): the loss never "
        "ran self._get_per_token_logps_and_entropies on the model it received with gradient"
    )
    assert "trl-lopti check --trainer_class test_composition.LoptiOwnLogitsTrainer" in message
    # The user's override is the cause: no TRL release to install.
    assert f"TRL {TRL_VERSION}" not in message and "pip install" not in message


# ------------------------------------------------------------------------------------------------ trl-lopti check
def test_the_check_proves_gmpo_and_a_loss_that_runs_the_forward_twice(single_thread):
    """Each relation the check prints can fail because of the user's class (the next tests): on GMPO, on a loss that
    takes its log-probabilities from one forward and its entropies from a second, and on RLOO's family, all pass."""
    for trainer_class in (LoptiGMPOTrainer, LoptiTwiceForwardTrainer, LoptiClippedRLOOTrainer):
        results = check_trainer_class(trainer_class)
        assert [result.name for result in results] == [
            f"{trainer_class.__name__} {name}" for name in ("train", "passes")
        ]
        assert all(result.passed for result in results), [result.line() for result in results]


def test_the_check_fails_a_loss_that_bypasses_the_forward_in_part_on_the_passes_relation(single_thread):
    results = {result.name.split()[-1]: result for result in check_trainer_class(LoptiNegativeLogLikelihoodTrainer)}
    assert results["train"].passed, "every runtime check passes: only the relation finds it"
    assert (
        results["passes"].status == "FAIL" and "does not go through the log-probabilities" in results["passes"].detail
    )
    assert "NegativeLogLikelihoodTrainer._compute_loss" in results["passes"].detail


def test_the_check_fails_a_loss_that_never_runs_the_forward_once_and_runs_nothing_after_it(single_thread):
    results = check_trainer_class(LoptiOwnLogitsTrainer)
    lines = [result.line() for result in results]
    print("\n".join(lines))  # noqa: T201 - what a user sees (pytest -s)
    assert [result.status for result in results] == ["FAIL", "SKIP"], lines
    assert results[0].broken == ("S2",) and "OwnLogitsTrainer._compute_loss" in results[0].detail
    assert results[1].detail == "it needs the train relation"


@pytest.mark.parametrize(
    "trainer_class, expected",
    [
        ("no_such_module.LoptiTrainer", "importing no_such_module failed: ModuleNotFoundError"),
        ("my_trainers.Missing", "my_trainers has no class Missing"),
        ("my_trainers.GMPOTrainer", "GMPOTrainer is not a Lopti trainer: compose it with one"),
        ("my_trainers", "give MODULE.CLASS"),
    ],
)
def test_the_command_says_in_one_line_why_it_cannot_check_a_class(
    tmp_path, monkeypatch, capsys, trainer_class, expected
):
    (tmp_path / "my_trainers.py").write_text("from trl.experimental.gmpo import GMPOTrainer\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--trainer_class", trainer_class]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("trl-lopti check: ") and expected in lines[0], lines


@pytest.mark.parametrize(
    "config_class, expected",
    [
        ("trl_lopti.LoptiGRPOConfig", "LoptiGRPOConfig does not fit LoptiGMPOTrainer, which trains with a GMPOConfig"),
        ("trl.RLOOConfig", "RLOOConfig is not a config of GRPOConfig's family"),
    ],
)
def test_a_config_class_that_does_not_fit_the_trainer_is_refused_in_one_line(
    tmp_path, monkeypatch, capsys, config_class, expected
):
    # A module name of this test's own: the my_trainers another test imports in this process holds no Lopti trainer.
    (tmp_path / "gmpo_trainers.py").write_text(
        "from trl.experimental.gmpo import GMPOTrainer\nfrom trl_lopti import LoptiGRPOTrainer\n\n\n"
        "class LoptiGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer): ...\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--trainer_class", "gmpo_trainers.LoptiGMPOTrainer", "--config_class", config_class]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("trl-lopti check: ") and expected in lines[0], lines


def test_a_module_that_fails_to_import_gives_one_line_and_no_traceback(tmp_path):
    (tmp_path / "broken_trainers.py").write_text("import torch\nraise RuntimeError('a bug in my module')\n")
    completed = subprocess.run(
        [sys.executable, "-m", "trl_lopti", "check", "--trainer_class", "broken_trainers.LoptiTrainer"],
        cwd=tmp_path,
        # conftest's WANDB_MODE=offline makes wandb print a line of its own.
        env={name: value for name, value in os.environ.items() if name != "WANDB_MODE"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 2 and "Traceback" not in completed.stdout + completed.stderr
    expected = (
        "trl-lopti check: --trainer_class broken_trainers.LoptiTrainer: importing broken_trainers failed: "
        "RuntimeError: a bug in my module"
    )
    assert completed.stdout.splitlines() == [expected]
