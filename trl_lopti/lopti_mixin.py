"""The Lopti mechanism, written once for both trainers: the two-pass schedule, the split, token isolation,
the pass metrics, checkpoints inside a generation batch, and the runtime checks of the TRL facts.

[`LoptiTrainerMixin`] sits in front of a TRL trainer (`GRPOTrainer` or `RLOOTrainer`, which TRL keeps in
parity). Each Lopti trainer adds only what differs: where pi_old comes from, how AR enters its loss, and the
TRL facts it relies on (`trl_lopti/grpo_trainer.py` for GRPO, `trl_lopti/rloo_trainer.py` for RLOO). The math
is in `trl_lopti/core_algos.py`.

- Schedule. TRL runs the passes itself (docs/trainers/grpo.md, "The Lopti schedule"): `self.num_iterations`,
  TRL's count of the times a generation batch is trained, is the user's `num_iterations` times the passes, so
  TRL's sampler serves each generation batch once per pass and its `_prepare_inputs` replays the buffered
  micro-batches in each (fact S1); TRL sees the user's value at generation, where it decides whether pi_old
  is needed (G2). Every optimizer step is an ordinary Trainer step; the pass of a micro-step follows from
  TRL's counter `_step`.
- Split. A generation batch is split once by pi_old (`lopti_low_mask`, with AR its weights
  `lopti_ar_weights`): at generation where pi_old is known there (TRL's, RLOO's, or the quantile rule's
  forward), which logs its metrics on the row of TRL's generation metrics; else (on-policy) each micro-batch
  at its first loss forward, whose detached output is pi_old: no extra forward, and the whole first iteration
  then fits in one optimizer step. Each generation batch gets its eta at generation (`lopti_batch_eta`): the
  quantile rule needs the whole batch's pi_old first.
- Isolation. In a pass, gradient flows only through the active tokens' log-probabilities and entropies; every
  value of the loss is the base trainer's.
- Checks. Every TRL fact the mechanism relies on (S1-S4, in `trl_lopti/trl_contract.py`) is checked while
  training by the functions at the end of this module, and stops the run before the update it would make
  wrong.

The mixin's own state is one [`LoptiState`] (`self._lopti`). Of TRL's attributes it changes one,
`num_iterations`: the user's value times the passes, and the user's value around generation.

The overrides, and why each stays: `training_step` (marks the micro-step in flight; checks S2-S4),
`compute_loss` (the pass's token group; checks S1 and the values AR placed),
`_get_per_token_logps_and_entropies` (the one place TRL's loss hands out the policy's log-probabilities:
split, AR, isolation), `_generate_and_score_completions` (pi_old, eta and the split of a new batch; TRL's
pi_old decision at the user's `num_iterations`), `_save_checkpoint` and `_load_optimizer_and_scheduler` (a
batch's schedule across a checkpoint).
"""

import dataclasses
import functools
import glob
import inspect
import os
import textwrap
import warnings
from typing import Any, ClassVar

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

# Checks the TRL version before TRL is imported.
from . import trl_contract


# isort: split
from trl.models.utils import disable_gradient_checkpointing

from .config import LoptiArguments, as_lopti_config
from .core_algos import (
    advantage_reweighting_weights,
    isolate_token_gradients,
    lopti_batch_threshold,
    loss_token_mask,
    low_probability_token_mask,
    reweight_token_gradients,
    token_group_mask,
    token_level_advantages,
)
from .utils import base_trainer_class, is_trl_lopti_class, temporarily_set, trl_completion_logps


logger = logging.get_logger(__name__)

# The keys the trainers add to TRL's batches: the low mask (B, T) of a split batch (pi_old < eta); with AR,
# the weights alpha * pi_old + 1 - alpha (B, T); under Lopti, the generation batch's eta (0-dim float64 on
# the CPU); the micro-step of its cycle at which a micro-batch was first trained.
LOW_MASK_KEY = "lopti_low_mask"
AR_WEIGHTS_KEY = "lopti_ar_weights"
ETA_KEY = "lopti_batch_eta"
FIRST_TRAINED_KEY = "lopti_first_trained_at"
LOPTI_BATCH_KEYS = (LOW_MASK_KEY, AR_WEIGHTS_KEY, ETA_KEY, FIRST_TRAINED_KEY)

GENERATION_BATCH_FILE = "lopti_generation_batch_rank{}.pt"
"""The file of each process in a checkpoint taken inside a generation batch."""

UNSPLIT_REPORTING_THRESHOLD = 0.5
"""The eta of `lopti/low_token_share` when Lopti is off (the paper's)."""

EMPTY_GROUP_WARNING_BATCHES = 3
"""The generation batches after which a token group that was empty in every one of them is warned about."""


LOPTI_PAPER_CITATION = textwrap.dedent("""\
    @article{yang2025lopti,
        title        = {{Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs}},
        author       = {Zhihe Yang and Xufang Luo and Zilong Wang and Dongqi Han and Zhiyuan He and Dongsheng Li and Yunjian Xu},
        year         = 2025,
        eprint       = {arXiv:2505.12929},
    }""")


def lopti_paper(base_trainer: type) -> dict[str, str]:
    """The model card's paper entry of a Lopti trainer: the Lopti paper, cited beside that of the trainer it
    extends, where it has one."""
    citation = LOPTI_PAPER_CITATION
    if base_trainer._paper.get("citation"):
        citation += "\n\n" + base_trainer._paper["citation"]
    return {
        "title": "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs",
        "id": "2505.12929",
        "citation": citation,
    }


class ReadRecorder(dict):
    """A dict that records every value read from it by key (`reads`): what TRL's loss read (fact G1)."""

    def __init__(self, values: dict[str, Any]):
        super().__init__(values)
        self.reads: dict[str, list[Any]] = {}

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        self.reads.setdefault(key, []).append(value)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        # dict.get would not go through __getitem__
        if key in self:
            return self[key]
        return default


@dataclasses.dataclass
class MicroStep:
    """
    The training micro-step in flight (TRL's `_step`), as `training_step` marks it for the hooks it runs.

    Args:
        position (`int`):
            Its position in its generation batch's cycle.
        first_visit (`bool`):
            Whether its micro-batch is trained for the first time (first pass, first iteration).
        backward_reached_logps (`bool`):
            Whether its backward reached the log-probabilities handed to TRL's loss (fact S2).
    """

    position: int
    first_visit: bool
    backward_reached_logps: bool = False


@dataclasses.dataclass
class LossCall:
    """
    What one `compute_loss` call shares with the policy forward TRL runs inside it.

    Args:
        batch (`dict`):
            The micro-batch (TRL's buffered dict, which keeps TRL's advantages) and its split.
        loss_inputs (`ReadRecorder`):
            What TRL's `_compute_loss` reads: a copy of the micro-batch, which records its reads.
        token_group (`str` or `None`):
            The tokens that carry gradient in this pass: `"low"`, `"high"`, or `None` for all.
        trains_aux_loss (`bool`):
            Whether a MoE router's auxiliary loss keeps its gradient (the first pass only).
        micro_step (`MicroStep` or `None`):
            The training micro-step it belongs to; `None` for a call outside training.
        placed (`dict`):
            The values a trainer placed in `loss_inputs` during the forward, which TRL's loss must read
            (fact G1).
    """

    batch: dict[str, Any]
    loss_inputs: ReadRecorder
    token_group: str | None
    trains_aux_loss: bool
    micro_step: MicroStep | None
    placed: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SplitTotals:
    """The split of some completion tokens: how many are low, the sum of their AR weights, how many in
    all."""

    low_tokens: torch.Tensor
    ar_weight_sum: torch.Tensor
    tokens: torch.Tensor

    def __add__(self, other: "SplitTotals") -> "SplitTotals":
        return SplitTotals(
            self.low_tokens + other.low_tokens, self.ar_weight_sum + other.ar_weight_sum, self.tokens + other.tokens
        )


@dataclasses.dataclass
class LoptiState:
    """
    What the Lopti mechanism keeps between TRL's hooks: one per trainer, `self._lopti`.

    Args:
        advantage_reweighting_form (`str`):
            How AR enters the loss (`LoptiTrainerMixin.advantage_reweighting_form`), decided at construction.
        micro_step (`MicroStep` or `None`):
            The training micro-step in flight, between `training_step`'s start and end.
        loss_call (`LossCall` or `None`):
            The `compute_loss` call in flight.
        generation_logps (`list[torch.Tensor]` or `None`):
            While TRL scores a generation batch: the log-probabilities of each forward it runs, in order.
        split_totals (`SplitTotals` or `None`):
            The split of the micro-batches of the generation batch in training that were split so far
            (on-policy).
        cycle_prompts (`list` or `None`):
            The prompts the dataloader served at this cycle's first micro-step.
        resumed_ignoring_data_skip (`bool`):
            Whether the run resumed from a checkpoint with `ignore_data_skip=True`: its dataloader may then serve
            other prompts inside a cycle.
        warned_prompts (`bool`):
            Whether the dataloader was found serving other prompts inside a cycle, and said so.
        gradient_outside_the_mask (`torch.Tensor` or `float`):
            The gradient that reached tokens outside the loss mask in this optimizer step, summed on the device
            (fact S4).
        empty_groups (`list`):
            The token group each of the first generation batches left empty (`None`: neither).
        warned_empty_group (`bool`):
            Whether the first generation batches were looked at for a token group that stays empty.
    """

    advantage_reweighting_form: str = "gradients"
    micro_step: MicroStep | None = None
    loss_call: LossCall | None = None
    generation_logps: list[torch.Tensor] | None = None
    split_totals: SplitTotals | None = None
    cycle_prompts: list[Any] | None = None
    resumed_ignoring_data_skip: bool = False
    warned_prompts: bool = False
    gradient_outside_the_mask: torch.Tensor | float = 0.0
    empty_groups: list[str | None] = dataclasses.field(default_factory=list)
    warned_empty_group: bool = False


class LoptiTrainerMixin:
    """
    Advantage Reweighting and Lopti for a TRL trainer whose schedule, loss hooks and checkpoint hooks are
    `GRPOTrainer`'s (facts S1-S4): the base of [`LoptiGRPOTrainer`] and [`LoptiRLOOTrainer`].

    A Lopti trainer sets the class attributes below, and implements where pi_old comes from
    (`old_per_token_logps_at_generation`) and, where its loss reads token-level advantages, says so
    (`advantage_reweighting_form`).

    It composes with any subclass of the TRL trainer, the Lopti class first (`class
    LoptiGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer)`): the trainer it extends names the run, gives the default
    config, and its loss gets the log-probabilities of `_get_per_token_logps_and_entropies` split, reweighted and
    isolated (docs/trainers/own.md).
    """

    # The trainer's Lopti config (a `LoptiArguments`), the TRL trainer it extends, and its name in
    # `trl-lopti check`.
    config_class: ClassVar[type]
    trl_trainer_class: ClassVar[type]
    contract_name: ClassVar[str]
    # Whether TRL's loss of a micro-step is divided by the gradient accumulation steps.
    loss_is_scaled_for_accumulation: ClassVar[bool]
    # The fact by which TRL's loss reads what AR places in its inputs.
    placement_fact: ClassVar[trl_contract.TRLFact] = trl_contract.LOSS_FORWARD

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A trainer of the family placed before the Lopti class (`class X(GMPOTrainer, LoptiGRPOTrainer)`) would run
        # its own hooks first, and may skip Lopti's.
        mro = cls.__mro__
        before = mro[: mro.index(LoptiTrainerMixin)]
        trl_trainer_class = getattr(cls, "trl_trainer_class", None)
        if trl_trainer_class is None:
            return
        for klass in before:
            if issubclass(klass, trl_trainer_class) and not issubclass(klass, LoptiTrainerMixin):
                lopti = next(k for k in mro if is_trl_lopti_class(k) and "trl_trainer_class" in vars(k))
                raise TypeError(
                    f"{cls.__name__} puts {klass.__name__} before {lopti.__name__} in its bases, so {klass.__name__}'s "
                    f"methods would run before Lopti's, and could skip them: put the Lopti class first, `class "
                    f"{cls.__name__}({lopti.__name__}, {klass.__name__})`"
                )

    def __init__(self, model, reward_funcs=None, args=None, *extra_args, **kwargs):
        trainer_class = type(self)
        args = as_lopti_config(args, model, trainer_class)
        # An untested TRL release trains once `trl-lopti check` has passed on this machine.
        trl_contract.require_verified_contract(self.contract_name, args)
        self._lopti = LoptiState(advantage_reweighting_form=self.advantage_reweighting_form(args))
        # The trainer this class extends (TRL's, or a user's such as GMPOTrainer) names the run: the model's tags
        # (set inside TRL's __init__), the model card's "trained with" and its paper, TRL's own where neither
        # method is on.
        base = base_trainer_class(trainer_class, self.trl_trainer_class)
        self._tag_names = [*base._tag_names, "lopti"]
        self._name = describe_method(args, base.__name__.removesuffix("Trainer"))
        self._paper = lopti_paper(base) if args.advantage_reweighting_enabled or args.lopti_enabled else base._paper
        # The base's arguments by keyword, as a user's class may take them (`GMPOTrainer`: `**kwargs`).
        names = positional_argument_names(trainer_class, self.trl_trainer_class)
        if len(extra_args) > len(names):
            raise TypeError(f"{trainer_class.__name__} takes at most {len(names) + 3} positional arguments")
        for name, value in zip(names, extra_args, strict=False):
            if name in kwargs:
                raise TypeError(f"{trainer_class.__name__} got multiple values for argument '{name}'")
            kwargs[name] = value
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        # Fact S1: TRL trains each generation batch `self.num_iterations` times, once per pass here. It is the one
        # attribute of TRL's the mixin changes, and TRL sees the user's value where it decides whether it needs
        # pi_old (`_generate_and_score_completions`).
        self.num_iterations = args.num_iterations * args.lopti_num_passes
        if args.lopti_enabled:
            steps = args.lopti_cycle_micro_steps // args.gradient_accumulation_steps
            logger.info(
                f"{trainer_class.__name__}: Lopti trains each generation batch once per token group ({steps} "
                f"optimizer steps per batch, {steps // 2} without Lopti): max_steps, save_steps, logging_steps and "
                "the learning-rate schedule count both passes, and a max_steps buys half the rollouts it buys "
                f"{base.__name__}. Compare runs at equal generation batches."
            )

    # ------------------------------------------------------------------------------------------------ what differs
    def old_per_token_logps_at_generation(
        self, batch: dict[str, Any], generation_logps: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """
        Where pi_old comes from: pi_old of a generation batch as TRL computed it while scoring it.

        Args:
            batch (`dict`):
                This process's part of the generation batch, as TRL returned it.
            generation_logps (`list[torch.Tensor]`):
                The log-probabilities of the forwards TRL ran while scoring it, in order.

        Returns:
            `torch.Tensor` or `None`: pi_old (B, T), or `None` where TRL computed none (on-policy: the first loss
            forward of each micro-batch then gives it).
        """
        raise NotImplementedError

    def advantage_reweighting_form(self, args: LoptiArguments) -> str:
        """
        How AR enters this trainer's loss: `"advantages"`, token-level advantages `w(i, t) * A(i)` (B, T) placed
        where the loss reads them (the paper's form, exact only in a loss that reads them per token), or
        `"gradients"`, its general form: the gradient through each token's log-probability scaled by `w(i, t)`,
        every value of the loss unchanged ([`~trl_lopti.core_algos.reweight_token_gradients`]).

        Args:
            args (`LoptiArguments`):
                The run's config.

        Returns:
            `str`: `"gradients"` here; a trainer whose loss reads token-level advantages says where.
        """
        return "gradients"

    def apply_advantage_reweighting(self, call: LossCall, per_token_logps: torch.Tensor) -> torch.Tensor:
        """
        Makes the loss reweight each token by its AR weight (`call.batch[AR_WEIGHTS_KEY]`), in the form
        [`advantage_reweighting_form`] chose.

        Args:
            call (`LossCall`):
                The loss call in flight.
            per_token_logps (`torch.Tensor`):
                The policy's log-probabilities (B, T) of this forward.

        Returns:
            `torch.Tensor`: the log-probabilities the loss reads.
        """
        weights = call.batch[AR_WEIGHTS_KEY]
        if self._lopti.advantage_reweighting_form == "gradients":
            return reweight_token_gradients(per_token_logps, weights)
        # A'(i, t) = w(i, t) * A(i) in what the loss reads, which it reads after this forward (fact G1).
        advantages = token_level_advantages(call.batch["advantages"], weights.size(1)) * weights
        self.place_loss_input(call, "advantages", advantages)
        return per_token_logps

    def place_loss_input(self, call: LossCall, key: str, value: Any) -> None:
        """Puts `value` under `key` in what TRL's loss reads, during its forward; the loss must then read it
        (checked after the loss under `placement_fact`)."""
        call.loss_inputs[key] = value
        call.placed[key] = value

    # ------------------------------------------------------------------------------------------------ schedule
    def lopti_pass_index(self) -> int:
        """The pass over its generation batch of the current training micro-step (0 without Lopti)."""
        return (self._step % self.args.lopti_cycle_micro_steps) // self.args.lopti_pass_micro_steps

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self._step
        cycle = self.args.lopti_cycle_micro_steps
        accumulation = self.args.gradient_accumulation_steps
        prompts = prompts_of(inputs)
        if step % cycle == 0 or self._lopti.cycle_prompts is None:
            self._lopti.cycle_prompts = prompts
        elif prompts != self._lopti.cycle_prompts and not self._lopti.warned_prompts:
            # Expected for the rest of a run resumed with ignore_data_skip=True: a warning. Else a stop.
            if not self._lopti.resumed_ignoring_data_skip:
                check_prompts(type(self), step % cycle, cycle, prompts)
            self._lopti.warned_prompts = True
            warn_prompts_changed(step % cycle)
        check_step_counter(type(self), step, self.state.global_step, accumulation, cycle)
        micro_step = MicroStep(position=step % cycle, first_visit=step % cycle < self.args.steps_per_generation)
        self._lopti.micro_step = micro_step
        try:
            output = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._lopti.micro_step = None
        check_backward_reached(type(self), micro_step.backward_reached_logps)
        # Fact S4 is read at the last micro-step of each optimizer step, before the optimizer steps: not at every
        # micro-step, as reading a value of the device waits for it.
        if (step + 1) % accumulation == 0:
            outside = self._lopti.gradient_outside_the_mask
            self._lopti.gradient_outside_the_mask = 0.0
            check_loss_mask(type(self), float(outside))
        return output

    def _mark_backward(self, micro_step: MicroStep, loss_mask: torch.Tensor, gradient: torch.Tensor) -> None:
        """A tensor hook on the log-probabilities handed to TRL's loss: its backward reached them (fact S2), and
        what reached the tokens outside the loss mask is added up, on the device (fact S4)."""
        micro_step.backward_reached_logps = True
        outside = gradient.abs() * (1 - loss_mask.to(gradient.dtype))
        self._lopti.gradient_outside_the_mask = self._lopti.gradient_outside_the_mask + outside.sum()

    # ------------------------------------------------------------------------------------------------ generation batch
    def _generate_and_score_completions(self, inputs):
        self._lopti.generation_logps = []
        try:
            # Fact G2: TRL decides whether it needs pi_old by the user's num_iterations.
            with temporarily_set(self, num_iterations=self.args.num_iterations):
                output = super()._generate_and_score_completions(inputs)
            old_per_token_logps = self.old_per_token_logps_at_generation(output, self._lopti.generation_logps)
        finally:
            self._lopti.generation_logps = None
        if old_per_token_logps is not None:
            output["old_per_token_logps"] = old_per_token_logps
        if self.args.lopti_enabled:
            # A 0-dim float64 tensor on the CPU (MPS has no float64), copied to each micro-batch.
            output[ETA_KEY] = torch.tensor(self.lopti_eta(output), dtype=torch.float64)
        # Where pi_old is known, the whole batch is split now.
        if output.get("old_per_token_logps") is not None:
            totals, eta = self._split(output, output["old_per_token_logps"])
            self._log_split(totals, eta)
        return output

    def lopti_eta(self, batch: dict[str, Any]) -> float:
        """
        eta of a generation batch: `lopti_threshold`, or the `lopti_quantile` quantile of pi_old over the
        whole batch (every process). Override it to split otherwise.

        Args:
            batch (`dict`):
                This process's part of the generation batch, as TRL generated it.

        Returns:
            `float`: eta in [0, 1].
        """
        args = self.args
        if args.lopti_quantile is None:
            return args.lopti_threshold
        # Where TRL did not need pi_old: one no-grad forward, as TRL's own.
        if batch.get("old_per_token_logps") is None:
            batch_size = args.per_device_train_batch_size if self.model.training else args.per_device_eval_batch_size
            with torch.no_grad(), disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs):
                batch["old_per_token_logps"] = trl_completion_logps(self, batch, batch_size=batch_size)[0]
        local = batch["old_per_token_logps"][loss_token_mask(batch).bool()]
        logps = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0))
        counted = self.accelerator.gather(self.accelerator.pad_across_processes(torch.ones_like(local), dim=0))
        return lopti_batch_threshold(logps, counted, args.lopti_quantile)

    # ------------------------------------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = self.model.training
        pass_index = self.lopti_pass_index() if training else 0
        token_group = self.args.lopti_pass_order[pass_index] if training else None
        micro_step = self._lopti.micro_step if training else None
        if micro_step is not None:
            first_position = micro_step.position % self.args.steps_per_generation
            expected = None if micro_step.first_visit else first_position
            check_micro_batch(type(self), micro_step.position, expected, inputs.get(FIRST_TRAINED_KEY))
            inputs[FIRST_TRAINED_KEY] = first_position
        call = LossCall(inputs, ReadRecorder(inputs), token_group, pass_index == 0, micro_step)
        self._lopti.loss_call = call
        try:
            loss = super().compute_loss(model, call.loss_inputs, return_outputs, num_items_in_batch)
        finally:
            self._lopti.loss_call = None
        check_loss_read(type(self), call.placed, call.loss_inputs.reads, self.placement_fact)
        if token_group is not None:
            self._log_pass_loss(token_group, loss.detach())
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        output = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        check_forward_output(type(self), output)
        per_token_logps, entropies, aux_loss = output
        call = self._lopti.loss_call
        # A forward outside the loss: pi_old, or the reference model's log-probabilities.
        if call is None:
            if self._lopti.generation_logps is not None:
                self._lopti.generation_logps.append(per_token_logps)
            return per_token_logps, entropies, aux_loss
        # Where pi_old was not known at generation, this forward's output is pi_old.
        if LOW_MASK_KEY not in call.batch:
            self._split_at_first_forward(call, per_token_logps.detach())
        if self.args.advantage_reweighting_enabled:
            per_token_logps = self.apply_advantage_reweighting(call, per_token_logps)
        # Lopti: gradient only through the pass's active tokens.
        if call.token_group is not None:
            active_mask = token_group_mask(call.batch[LOW_MASK_KEY], loss_token_mask(call.batch), call.token_group)
            per_token_logps = isolate_token_gradients(per_token_logps, active_mask)
            if entropies is not None:
                entropies = isolate_token_gradients(entropies, active_mask)
            if aux_loss is not None and not call.trains_aux_loss:
                aux_loss = aux_loss.detach()
        # Facts S2 and S4 are checked in the backward.
        if call.micro_step is not None and per_token_logps.requires_grad:
            mark = functools.partial(self._mark_backward, call.micro_step, loss_token_mask(call.batch))
            per_token_logps.register_hook(mark)
        return per_token_logps, entropies, aux_loss

    # ------------------------------------------------------------------------------------------------ split
    def _split_eta(self, batch: dict[str, Any]) -> float:
        """The eta `batch` is split at: its generation's (`ETA_KEY`), else the fixed eta; 0.5 for reporting
        only."""
        if not self.args.lopti_enabled:
            return UNSPLIT_REPORTING_THRESHOLD
        if ETA_KEY not in batch and self.args.lopti_quantile is not None:
            raise RuntimeError(f"lopti_quantile: this batch has no eta from its generation ({ETA_KEY})")
        return float(batch.get(ETA_KEY, self.args.lopti_threshold))

    def _split(self, batch: dict[str, Any], old_per_token_logps: torch.Tensor) -> tuple[SplitTotals, float]:
        """Splits `batch` (a generation batch or a micro-batch) by its pi_old: its low mask and, with AR, its
        AR weights; returns its totals and the eta it was split at."""
        eta = self._split_eta(batch)
        mask = loss_token_mask(batch)
        low_mask = low_probability_token_mask(old_per_token_logps, mask, eta)
        batch[LOW_MASK_KEY] = low_mask
        weights = advantage_reweighting_weights(old_per_token_logps, self.args.advantage_reweighting_alpha)
        if self.args.advantage_reweighting_enabled:
            batch[AR_WEIGHTS_KEY] = weights
        mask = mask.float()
        totals = SplitTotals((low_mask.float() * mask).sum(), (weights.float() * mask).sum(), mask.sum())
        return totals, eta

    def _split_at_first_forward(self, call: LossCall, forward_logps: torch.Tensor) -> None:
        """Splits a micro-batch at its first loss forward, where pi_old is the batch's or, on-policy, that
        forward's detached output; logs the split once the generation batch's last micro-batch is split."""
        batch = call.batch
        old_per_token_logps = batch.get("old_per_token_logps")
        # On-policy, pi_old is this forward's output; a later pass's ratio is against it.
        if old_per_token_logps is None:
            if call.micro_step is not None:
                check_on_policy(
                    type(self), self._step, call.micro_step.position, self.args.gradient_accumulation_steps
                )
            old_per_token_logps = forward_logps
            if self.args.lopti_enabled:
                batch["old_per_token_logps"] = old_per_token_logps
        totals, eta = self._split(batch, old_per_token_logps)
        # An evaluation batch is its own generation batch.
        if not self.model.training:
            self._log_split(totals, eta)
            return
        position = self._step % self.args.steps_per_generation
        if position == 0 or self._lopti.split_totals is None:
            self._lopti.split_totals = totals
        else:
            self._lopti.split_totals = self._lopti.split_totals + totals
        if position == self.args.steps_per_generation - 1:
            self._log_split(self._lopti.split_totals, eta)
            self._lopti.split_totals = None

    # ------------------------------------------------------------------------------------------------ metrics
    def _log_split(self, totals: SplitTotals, eta: float) -> None:
        """Logs the split of a whole generation batch, from the `totals` of this process."""
        mode = "train" if self.model.training else "eval"
        stacked = torch.stack([totals.low_tokens, totals.ar_weight_sum, totals.tokens])
        reduced = self.accelerator.reduce(stacked, reduction="sum")
        low_tokens = reduced[0]
        ar_weight_sum = reduced[1]
        tokens = reduced[2]
        # No completion token anywhere: nothing to report.
        if tokens == 0:
            return
        self._metrics[mode]["lopti/low_token_share"].append((low_tokens / tokens).item())
        if self.args.advantage_reweighting_enabled:
            self._metrics[mode]["lopti/ar_weight_mean"].append((ar_weight_sum / tokens).item())
        if self.args.lopti_enabled:
            self._metrics[mode]["lopti/threshold"].append(eta)
            if mode == "train":
                self._warn_if_a_group_stays_empty(int(low_tokens), int(tokens), eta)

    def _warn_if_a_group_stays_empty(self, low_tokens: int, tokens: int, eta: float) -> None:
        """Warns where the first generation batches all left the same token group empty."""
        if self._lopti.warned_empty_group:
            return
        empty_groups = self._lopti.empty_groups
        if low_tokens == 0:
            empty_groups.append("low")
        elif low_tokens == tokens:
            empty_groups.append("high")
        else:
            empty_groups.append(None)
        if len(empty_groups) < EMPTY_GROUP_WARNING_BATCHES:
            return
        self._lopti.warned_empty_group = True
        empty = empty_groups[0] if len(set(empty_groups)) == 1 else None
        if empty is not None:
            warnings.warn(
                f"Lopti: no completion token was {empty} (eta = {eta:.4g}) in any of the first "
                f"{EMPTY_GROUP_WARNING_BATCHES} generation batches, so every {empty} pass had zero gradient: its "
                "optimizer steps only apply momentum and weight decay. A random or untrained model puts every "
                "token on one side of eta. Set lopti_quantile (e.g. 0.5: each batch split at its median pi_old), "
                "or a lopti_threshold that splits your model's tokens.",
                UserWarning,
                stacklevel=2,
            )

    def _log_pass_loss(self, token_group: str, loss: torch.Tensor) -> None:
        """Logs a pass's loss on its optimizer step's scale."""
        scale = self.current_gradient_accumulation_steps if self.loss_is_scaled_for_accumulation else 1
        value = self.accelerator.gather((loss * scale).reshape(1)).mean().item()
        self._metrics["train"][f"lopti/loss_{token_group}_pass"].append(value)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _schedule_signature(self) -> dict[str, Any]:
        """What a checkpoint taken inside a generation batch's schedule must be resumed with."""
        args = self.args
        return {
            "num_processes": self.accelerator.num_processes,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "steps_per_generation": args.steps_per_generation,
            "num_iterations": args.num_iterations,
            "lopti_order": args.lopti_order if args.lopti_enabled else None,
            # The saved batch holds its AR weights.
            "advantage_reweighting_alpha": args.advantage_reweighting_alpha,
        }

    def _save_checkpoint(self, model, trial):
        # Inside a generation batch's schedule, the batch and its split are kept for the rest of it
        # (fact S3), in the folder transformers saves the checkpoint to, before it is pushed.
        if self._step % self.args.lopti_cycle_micro_steps != 0 and self._buffered_inputs is not None:
            checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), checkpoint)
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, GENERATION_BATCH_FILE.format(self.accelerator.process_index))
            torch.save({"micro_batches": self._buffered_inputs, "schedule": self._schedule_signature()}, path)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        saved = glob.glob(os.path.join(checkpoint, GENERATION_BATCH_FILE.format("*"))) if checkpoint else []
        schedule = self._schedule_signature()
        path = os.path.join(checkpoint or "", GENERATION_BATCH_FILE.format(self.accelerator.process_index))
        # Each process resumes its own part of the batch.
        if saved and not os.path.exists(path):
            raise resume_error(checkpoint, {"num_processes": len(saved)}, schedule)
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint and self.args.ignore_data_skip:
            self._lopti.resumed_ignoring_data_skip = True
        accumulation = self.args.gradient_accumulation_steps
        cycle = self.args.lopti_cycle_micro_steps
        # A checkpoint on a boundary of the schedule it was saved with, but not of this run's.
        if checkpoint and not saved and cycle % accumulation == 0 and self.state.global_step * accumulation % cycle:
            raise ValueError(
                f"{checkpoint} holds no generation batch, yet lies inside one of this run's schedule, {schedule}: "
                "resume it with the schedule it was saved with, or from a checkpoint between this one's batches"
            )
        if not saved:
            return
        # Loaded on the CPU, then moved to the device, but the eta, which stays on the CPU in float64.
        stored = torch.load(path, map_location="cpu")
        if stored["schedule"] != schedule:
            raise resume_error(checkpoint, stored["schedule"], schedule)
        check_resumed_state(type(self), self.state.global_step)
        device = self.accelerator.device
        # The run resumes inside the batch's schedule, at the micro-step it stopped at.
        self._buffered_inputs = [
            {key: value.to(device) if torch.is_tensor(value) and key != ETA_KEY else value for key, value in b.items()}
            for b in stored["micro_batches"]
        ]
        self._step = self.state.global_step * self.args.gradient_accumulation_steps


# ---------------------------------------------------------------------------------------------------- runtime checks
# Each raises `trl_contract.broken_fact` where TRL no longer behaves as a fact of `trl_contract.TRL_FACTS`
# says, before the update it would make wrong.
def prompts_of(generation_batch: Any) -> list[Any] | None:
    """The prompts of a generation batch as TRL's dataloader serves it (a list of rows)."""
    if isinstance(generation_batch, list):
        return [row.get("prompt") for row in generation_batch]
    return None


def check_forward_output(trainer_class: type, output: Any) -> None:
    """Fact S2: TRL's log-prob forward returned (log-probabilities, entropies, auxiliary loss). Where it does
    not, the run could not go on anyway: the check names the fact, so that `trl-lopti check` finds it
    broken."""
    if not isinstance(output, tuple) or len(output) != 3:
        saw = f"{len(output)} values" if isinstance(output, tuple) else type(output).__name__
        saw = f"_get_per_token_logps_and_entropies returned {saw}, not three"
        raise trl_contract.broken_fact(trl_contract.LOSS_FORWARD, saw, trainer_class)


def check_prompts(trainer_class: type, position: int, cycle: int, prompts: list[Any] | None) -> None:
    """Fact S1, at every micro-step but a run resumed with `ignore_data_skip=True`: the dataloader served the
    prompts of its cycle's first micro-step; here it served others (`prompts`) at micro-step `position` of a
    `cycle`-micro-step cycle."""
    first = f", the first {str(prompts[0])[:60]!r}" if prompts else ""
    saw = (
        f"at micro-step {position} of a Lopti cycle ({cycle} micro-steps per generation batch) TRL's dataloader "
        f"served other prompts than at the cycle's first ({len(prompts or [])} prompts{first}). TRL generates only "
        f"at a cycle's first micro-step, so the prompts served from micro-step {position} to the cycle's end would "
        "never be trained: the sampler no longer repeats each generation batch once per pass "
        f"(self.num_iterations * steps_per_generation = {cycle} times)"
    )
    raise trl_contract.broken_fact(trl_contract.SCHEDULE, saw, trainer_class)


def warn_prompts_changed(position: int) -> None:
    """Warns that, in a run resumed with `ignore_data_skip=True`, TRL's dataloader served other prompts at
    micro-step `position` of a cycle than at its first."""
    warnings.warn(
        f"trl_lopti: at micro-step {position} of a Lopti cycle TRL's dataloader served other prompts than at the "
        "cycle's first, as it does after resuming with ignore_data_skip=True. TRL generates only at a cycle's first "
        "micro-step, so the prompts served until the cycle ends are not trained: every update is still the "
        "method's, but this run trains part of its dataset.",
        UserWarning,
        stacklevel=3,
    )


def check_step_counter(trainer_class: type, step: int, global_step: int, accumulation: int, cycle: int) -> None:
    """Fact S3: at an optimizer step's first micro-step, TRL's counter `_step` lies where `global_step`
    optimizer steps of `accumulation` micro-steps put it in a `cycle`-micro-step cycle."""
    if cycle % accumulation == 0 and step % accumulation == 0 and (global_step * accumulation - step) % cycle:
        saw = (
            f"at optimizer step {global_step} TRL's micro-step counter _step is {step}, not where {accumulation} "
            f"micro-steps per optimizer step put it in a {cycle}-micro-step cycle (a resumed run whose "
            "_load_optimizer_and_scheduler did not run?)"
        )
        raise trl_contract.broken_fact(trl_contract.CHECKPOINTS, saw, trainer_class)


def check_resumed_state(trainer_class: type, global_step: int) -> None:
    """Fact S3: a checkpoint inside a generation batch (an optimizer step in, at least) is resumed with the
    trainer state at `global_step` loaded."""
    if global_step == 0:
        saw = "_load_optimizer_and_scheduler ran before the trainer state was loaded"
        raise trl_contract.broken_fact(trl_contract.CHECKPOINTS, saw, trainer_class)


def check_micro_batch(trainer_class: type, position: int, first_position: int | None, trained_at: int | None) -> None:
    """Fact S1: the micro-batch served at micro-step `position` of its cycle, first trained at `trained_at`
    (`None`: never), is the one this cycle first trained at `first_position` (`None`: it is new)."""
    if trained_at != first_position:
        saw = f"micro-step {position} of a cycle got a micro-batch first trained at {trained_at}, not {first_position}"
        raise trl_contract.broken_fact(trl_contract.SCHEDULE, saw, trainer_class)


def check_loss_read(
    trainer_class: type, placed: dict[str, Any], reads: dict[str, list[Any]], fact: trl_contract.TRLFact
) -> None:
    """Fact `fact` (G1), after a loss: it read every value placed in its inputs during its forward (`placed`,
    by key), and nothing else under those keys (`reads`: what it read, by key)."""
    for key, value in placed.items():
        if not reads.get(key) or any(read is not value for read in reads[key]):
            raise trl_contract.broken_fact(
                fact, f"TRL's loss did not read the {key} placed during its forward", trainer_class
            )


def check_backward_reached(trainer_class: type, reached: bool) -> None:
    """Fact S2, after a training micro-step: its backward reached the log-probabilities handed to TRL's
    loss."""
    if not reached:
        saw = "the backward of a training step never reached the loss's log-probabilities"
        raise trl_contract.broken_fact(trl_contract.LOSS_FORWARD, saw, trainer_class)


def check_loss_mask(trainer_class: type, gradient_outside_the_mask: float) -> None:
    """Fact S4, before an optimizer step: the gradient that reached tokens outside the loss mask, summed, is
    zero."""
    if gradient_outside_the_mask != 0:
        saw = f"a gradient of {gradient_outside_the_mask:.3g} reached tokens outside the loss mask"
        raise trl_contract.broken_fact(trl_contract.LOSS_MASK, saw, trainer_class)


def check_on_policy(trainer_class: type, step: int, position: int, accumulation: int) -> None:
    """Fact G2: a micro-batch without pi_old, first trained at micro-step `step` (`position` of its cycle,
    generated at the cycle's first), saw no optimizer step (every `accumulation` micro-steps) since its
    generation."""
    if (step - position) // accumulation != step // accumulation:
        saw = f"no pi_old came with a micro-batch first trained after an optimizer step (micro-step {position})"
        raise trl_contract.broken_fact(trl_contract.GRPO_GENERATION, saw, trainer_class)


def resume_error(checkpoint: str, saved: dict[str, Any], current: dict[str, Any]) -> ValueError:
    """The error for a checkpoint taken inside a generation batch with a schedule (`saved`) the run
    (`current`) lacks."""
    differ = [key for key in saved if saved[key] != current.get(key)]
    return ValueError(
        f"{checkpoint} was saved inside a generation batch with {', '.join(f'{k}={saved[k]}' for k in differ)}; this "
        f"run has {', '.join(f'{k}={current.get(k)}' for k in differ)}: resume it with the values it was saved with, or "
        "from a checkpoint between generation batches"
    )


def positional_argument_names(trainer_class: type, trl_trainer_class: type) -> list[str]:
    """
    The names, in order, of the arguments after `model`, `reward_funcs` and `args` that a Lopti trainer class
    takes by position: those of the `__init__` beneath the Lopti class (a user's base, TRL's trainer), followed,
    where it passes the rest on (`**kwargs`, as `GMPOTrainer`), by the TRL trainer's own.

    Args:
        trainer_class (`type`):
            The Lopti trainer class.
        trl_trainer_class (`type`):
            The TRL trainer it extends (`GRPOTrainer`, `RLOOTrainer`).
    """
    mro = trainer_class.__mro__
    beneath = mro[mro.index(LoptiTrainerMixin) + 1 :]
    init = next(vars(klass)["__init__"] for klass in beneath if "__init__" in vars(klass))
    parameters = list(inspect.signature(init).parameters.values())[1:]
    named = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    names = [name for name in named if name not in ("model", "reward_funcs", "args")]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        trl_names = list(inspect.signature(trl_trainer_class.__init__).parameters)[4:]
        names += [name for name in trl_names if name not in names]
    return names


def describe_method(config: LoptiArguments, base_name: str) -> str:
    """The method of a configuration in words, the model card's "trained with", e.g. `"GRPO with Advantage
    Reweighting (alpha=0.3) and Low-Probability Token Isolation (Lopti, eta=0.5, low tokens first)"`, for a
    trainer that extends `base_name` (`"GRPO"`, `"RLOO"`, `"GMPO"`)."""
    base = base_name
    if getattr(config, "advantage_estimator", None) == "reinforce_plus_plus":
        base = "REINFORCE++" if base_name == "GRPO" else f"{base_name} (REINFORCE++ advantages)"
    parts = []
    if config.advantage_reweighting_enabled:
        parts.append(f"Advantage Reweighting (alpha={config.advantage_reweighting_alpha:g})")
    if config.lopti_enabled:
        order = "low tokens first" if config.lopti_order == "low_first" else "high tokens first, the paper's ablation"
        if config.lopti_quantile is None:
            split = f"eta={config.lopti_threshold:g}"
        else:
            split = f"eta at the {config.lopti_quantile:g} quantile of each batch"
        parts.append(f"Low-Probability Token Isolation (Lopti, {split}, {order})")
    return f"{base} with {' and '.join(parts)}" if parts else base
