"""The Lopti mechanism, written once for both trainers: the two-pass schedule, the split, token isolation,
the pass metrics, checkpoints inside a generation batch, and the runtime checks of the TRL facts it relies on.

[`LoptiTrainerMixin`] sits in front of a TRL trainer (`GRPOTrainer` or `RLOOTrainer`, which TRL keeps in
parity). Each Lopti trainer adds only what differs: where pi_old comes from and how AR enters its loss
(`trl_lopti/grpo_trainer.py` for GRPO, `trl_lopti/rloo_trainer.py` for RLOO). The math is in
`trl_lopti/core_algos.py`.

The method enters TRL in three places:

- Generation (`_generate_and_score_completions`): pi_old of the whole generation batch (TRL's, or RLOO's
  per-token values), its eta, the low mask and AR's weights, fixed once and stored as tensors in the batch TRL
  buffers, so that TRL's own shuffle and split carry them to every micro-batch of both passes.
- The loss (`_compute_loss`): the pass of the micro-step, from TRL's counter `_step`; TRL's inputs (AR's
  token-level advantages where the loss reads them per token); and a [`LossScope`] that lives for the call.
- The log-prob forward (`_get_per_token_logps_and_entropies`): inside that scope, a forward of the model the
  loss received, with gradient, gets AR's general form and the pass's isolation. Every other forward (another
  model's, one without gradient, one over other rows) is returned as TRL computed it.

The schedule is TRL's own: `self.num_iterations`, TRL's count of the times a generation batch is trained, is
the user's `num_iterations` times the passes, so TRL's sampler serves each generation batch once per pass, its
`_prepare_inputs` replays the buffered micro-batches in each (fact S1), and TRL computes pi_old at generation,
since the batch then spans several optimizer steps (fact G2). Every optimizer step is an ordinary Trainer step:
gradient sync, clipping, the scheduler, DeepSpeed and FSDP run as they do for the base trainer.

Evaluation gets the base trainer's loss: no pass, no isolation, no reweighting. Each TRL fact the mechanism
relies on (`trl_lopti/trl_contract.py`) is checked where it is used, and stops the run before the update it
would make wrong.
"""

import dataclasses
import glob
import inspect
import os
import textwrap
import warnings
from typing import Any, ClassVar

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

# Checks the TRL version before TRL is imported.
from . import trl_contract


# isort: split
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
from .utils import base_trainer_class, is_trl_lopti_class


logger = logging.get_logger(__name__)

# The keys the trainers add to TRL's generation batches: the low mask (B, T) (pi_old < eta); with AR, the weights
# alpha * pi_old + 1 - alpha (B, T); under Lopti, the generation batch's eta (0-dim float64 on the CPU).
LOW_MASK_KEY = "lopti_low_mask"
AR_WEIGHTS_KEY = "lopti_ar_weights"
ETA_KEY = "lopti_batch_eta"
LOPTI_BATCH_KEYS = (LOW_MASK_KEY, AR_WEIGHTS_KEY, ETA_KEY)

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


@dataclasses.dataclass
class TokenSplit:
    """
    A batch split by its pi_old.

    Args:
        low_mask (`torch.Tensor`):
            The low tokens (B, T): completion tokens with `pi_old < eta`.
        ar_weights (`torch.Tensor` or `None`):
            AR's weights `alpha * pi_old + 1 - alpha` (B, T); `None` without AR.
    """

    low_mask: torch.Tensor
    ar_weights: torch.Tensor | None


@dataclasses.dataclass
class LossScope:
    """
    One training call of `_compute_loss`, as the log-prob forwards run inside it see it.

    Args:
        model (`torch.nn.Module`):
            The model `_compute_loss` received (wrapped under DDP, FSDP or DeepSpeed): only its forwards with
            gradient are reweighted and isolated.
        batch (`dict`):
            The micro-batch, as TRL buffered it.
        token_group (`str` or `None`):
            The tokens that carry gradient in this pass: `"low"`, `"high"`, or `None` for all.
        trains_aux_loss (`bool`):
            Whether a MoE router's auxiliary loss keeps its gradient (the first pass only).
        reweights_gradients (`bool`):
            Whether AR takes its general form in the forward.
        split (`TokenSplit` or `None`):
            The batch's split; `None` until known, where the batch came without pi_old (on-policy, AR alone): the
            first forward of the call carrying the method then gives pi_old, its detached output.
        policy_forwards (`int`):
            The forwards of the call reweighted and isolated so far.
    """

    model: Any
    batch: dict[str, Any]
    token_group: str | None
    trains_aux_loss: bool
    reweights_gradients: bool
    split: TokenSplit | None
    policy_forwards: int = 0


@dataclasses.dataclass
class LoptiState:
    """
    What the Lopti mechanism keeps between TRL's hooks: one per trainer, `self._lopti`.

    Args:
        advantage_reweighting_form (`str`):
            How AR enters the loss (`LoptiTrainerMixin.advantage_reweighting_form`), decided at construction.
        loss_scope (`LossScope` or `None`):
            The training `_compute_loss` call in flight.
        scoring_logps (`list[torch.Tensor]` or `None`):
            While TRL scores a generation batch: the log-probabilities of each forward it runs, in order (RLOO's
            pi_old is the first).
        cycle_prompts (`list` or `None`):
            The prompts the dataloader served at this cycle's first micro-step (fact S1).
        resumed_ignoring_data_skip (`bool`):
            Whether the run resumed from a checkpoint with `ignore_data_skip=True`: its dataloader may then serve
            other prompts inside a cycle.
        warned_prompts (`bool`):
            Whether the dataloader was found serving other prompts inside a cycle, and said so.
        gradient_outside_the_mask (`torch.Tensor` or `None`):
            The gradient that reached tokens outside the loss mask since the last optimizer step, summed on the device
            in the backward and read before the next optimizer step (fact S4).
        empty_groups (`list`):
            The token group each of the first generation batches left empty (`None`: neither).
        warned_empty_group (`bool`):
            Whether the first generation batches were looked at for a token group that stays empty.
    """

    advantage_reweighting_form: str = "gradients"
    loss_scope: LossScope | None = None
    scoring_logps: list[torch.Tensor] | None = None
    cycle_prompts: list[Any] | None = None
    resumed_ignoring_data_skip: bool = False
    warned_prompts: bool = False
    gradient_outside_the_mask: torch.Tensor | None = None
    empty_groups: list[str | None] = dataclasses.field(default_factory=list)
    warned_empty_group: bool = False


class LossMaskCheck(TrainerCallback):
    """Reads fact S4 before every optimizer step, on every process (the Trainer calls `on_pre_optimizer_step` there
    whatever the launcher)."""

    def __init__(self, trainer: "LoptiTrainerMixin"):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._check_loss_mask_before_the_optimizer_step()


class LoptiTrainerMixin:
    """
    Advantage Reweighting and Lopti for a TRL trainer whose schedule, loss hooks and checkpoint hooks are
    `GRPOTrainer`'s (facts S1-S4): the base of [`LoptiGRPOTrainer`] and [`LoptiRLOOTrainer`].

    A Lopti trainer sets the class attributes below, implements where pi_old comes from
    (`old_per_token_logps_at_generation`) and, where its loss reads token-level advantages, says so
    (`advantage_reweighting_form`).

    It composes with any subclass of the TRL trainer, the Lopti class first (`class
    LoptiGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer)`): the trainer it extends names the run, gives the default
    config, and its loss gets the log-probabilities of `_get_per_token_logps_and_entropies` reweighted and
    isolated ([Your own trainer][your-own-trainer]).
    """

    # The trainer's Lopti config (a `LoptiArguments`), the TRL trainer it extends, and its name in
    # `trl-lopti check`.
    config_class: ClassVar[type]
    trl_trainer_class: ClassVar[type]
    contract_name: ClassVar[str]
    # Whether TRL's loss of a micro-step is divided by the gradient accumulation steps.
    loss_is_scaled_for_accumulation: ClassVar[bool]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        trl_trainer_class = getattr(cls, "trl_trainer_class", None)
        if trl_trainer_class is None:
            return
        from transformers import Trainer

        mro = cls.__mro__
        lopti = next(k for k in mro if is_trl_lopti_class(k) and "trl_trainer_class" in vars(k))
        for klass in mro:
            # A trainer of the other family (`class X(LoptiGRPOTrainer, RLOOTrainer)`): its hooks are not those the
            # Lopti class extends.
            unrelated = not issubclass(klass, trl_trainer_class) and not issubclass(trl_trainer_class, klass)
            if isinstance(klass, type) and issubclass(klass, Trainer) and unrelated:
                raise TypeError(
                    f"{cls.__name__} composes {lopti.__name__}, which extends {trl_trainer_class.__name__}, with "
                    f"{klass.__name__}, which is not a {trl_trainer_class.__name__}: compose a Lopti class with a "
                    f"trainer of its own family (LoptiGRPOTrainer with a GRPOTrainer subclass, LoptiRLOOTrainer with "
                    "an RLOOTrainer subclass)"
                )
        # A trainer of the family placed before the Lopti class (`class X(GMPOTrainer, LoptiGRPOTrainer)`) would run
        # its own hooks first, and may skip Lopti's.
        before = mro[: mro.index(LoptiTrainerMixin)]
        for klass in before:
            if issubclass(klass, trl_trainer_class) and not issubclass(klass, LoptiTrainerMixin):
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
        # attribute of TRL's the mixin changes; TRL reads it where it builds the sampler, where it generates, and
        # where it decides whether it needs pi_old (fact G2).
        self.num_iterations = args.num_iterations * args.lopti_num_passes
        self.add_callback(LossMaskCheck(self))
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
        self, batch: dict[str, Any], scoring_logps: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """
        Where pi_old comes from: pi_old of a generation batch as TRL computed it while scoring it.

        Args:
            batch (`dict`):
                This process's part of the generation batch, as TRL returned it.
            scoring_logps (`list[torch.Tensor]`):
                The log-probabilities of the forwards TRL ran while scoring it, in order.

        Returns:
            `torch.Tensor` or `None`: pi_old (B, T), or `None` where TRL computed none and AR's general form
            takes it from the loss forward (on-policy, AR alone).
        """
        raise NotImplementedError

    @classmethod
    def advantage_reweighting_form(cls, args: LoptiArguments) -> str:
        """
        How AR enters this trainer class's loss (a class method: `trl-lopti grpo --dry_run` asks it too):
        `"advantages"`, token-level advantages `w(i, t) * A(i)` (B, T) in the loss's inputs (the paper's form,
        exact only in a loss that reads them per token), or `"gradients"`, its general form: the gradient through
        each token's log-probability scaled by `w(i, t)`, every value of the loss unchanged
        ([`~trl_lopti.core_algos.reweight_token_gradients`]).

        Args:
            args (`LoptiArguments`):
                The run's config.

        Returns:
            `str`: `"gradients"` here; a trainer whose loss reads token-level advantages says where.
        """
        return "gradients"

    # ------------------------------------------------------------------------------------------------ generation batch
    def _generate_and_score_completions(self, inputs):
        if self.model.training:
            check_generation_step(type(self), self._step, self.args.lopti_cycle_micro_steps)
        self._lopti.scoring_logps = []
        try:
            output = super()._generate_and_score_completions(inputs)
            old_per_token_logps = self.old_per_token_logps_at_generation(output, self._lopti.scoring_logps)
        finally:
            self._lopti.scoring_logps = None
        # On-policy AR alone: the loss forward gives pi_old.
        if old_per_token_logps is None:
            return output
        # The whole batch is split now, once for both passes; TRL's split and shuffle carry the tensors.
        eta = self.lopti_eta(output)
        split = self.split_tokens(output, old_per_token_logps, eta)
        output[LOW_MASK_KEY] = split.low_mask
        if split.ar_weights is not None:
            output[AR_WEIGHTS_KEY] = split.ar_weights
        if self.args.lopti_enabled:
            # A 0-dim float64 tensor on the CPU (MPS has no float64), copied to each micro-batch.
            output[ETA_KEY] = torch.tensor(eta, dtype=torch.float64)
        self._log_split(split, loss_token_mask(output), eta)
        return output

    def lopti_eta(self, batch: dict[str, Any]) -> float:
        """
        eta of a generation batch: `lopti_threshold`, or the `lopti_quantile` quantile of pi_old over the whole
        batch (every process, which all call this together); 0.5 without Lopti (for `lopti/low_token_share` only).
        Override it to split otherwise.

        Args:
            batch (`dict`):
                This process's part of the generation batch, with its pi_old (`old_per_token_logps`).

        Returns:
            `float`: eta in [0, 1].
        """
        args = self.args
        if not args.lopti_enabled:
            return UNSPLIT_REPORTING_THRESHOLD
        if args.lopti_quantile is None:
            return args.lopti_threshold
        local = batch["old_per_token_logps"][loss_token_mask(batch).bool()]
        logps = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0))
        counted = self.accelerator.gather(self.accelerator.pad_across_processes(torch.ones_like(local), dim=0))
        return lopti_batch_threshold(logps, counted, args.lopti_quantile)

    def split_tokens(self, batch: dict[str, Any], old_per_token_logps: torch.Tensor, eta: float) -> TokenSplit:
        """
        Splits a batch by its pi_old: the low tokens and, with AR, AR's weights.

        Args:
            batch (`dict`):
                A generation batch or a micro-batch, with its masks.
            old_per_token_logps (`torch.Tensor`):
                Its pi_old (B, T).
            eta (`float`):
                The threshold: a completion token is low where `pi_old < eta`.
        """
        low_mask = low_probability_token_mask(old_per_token_logps, loss_token_mask(batch), eta)
        ar_weights = None
        if self.args.advantage_reweighting_enabled:
            ar_weights = advantage_reweighting_weights(old_per_token_logps, self.args.advantage_reweighting_alpha)
        return TokenSplit(low_mask, ar_weights)

    def batch_split(self, batch: dict[str, Any]) -> TokenSplit | None:
        """The split of a micro-batch: the one its generation stored, else from its own pi_old at its eta (a
        batch made elsewhere, at the eta it carries or as a generation batch), else `None` (no pi_old: the loss
        forward gives it)."""
        if LOW_MASK_KEY in batch:
            return TokenSplit(batch[LOW_MASK_KEY], batch.get(AR_WEIGHTS_KEY))
        old_per_token_logps = batch.get("old_per_token_logps")
        if old_per_token_logps is None:
            return None
        eta = float(batch[ETA_KEY]) if ETA_KEY in batch else self.lopti_eta(batch)
        return self.split_tokens(batch, old_per_token_logps, eta)

    # ------------------------------------------------------------------------------------------------ schedule
    def lopti_token_group(self) -> str | None:
        """The token group active in the training micro-step in flight: `"low"` or `"high"`, `None` without
        Lopti."""
        position = self._step % self.args.lopti_cycle_micro_steps
        return self.args.lopti_pass_order[position // self.args.lopti_pass_micro_steps]

    def _prepare_inputs(self, generation_batch):
        if self.model.training:
            self._check_schedule(generation_batch)
        return super()._prepare_inputs(generation_batch)

    def _check_schedule(self, generation_batch: Any) -> None:
        """Facts S1 and S3 at a training micro-step: the dataloader serves a cycle's prompts until it ends, and
        TRL's counter `_step` lies where the optimizer steps put it."""
        step = self._step
        cycle = self.args.lopti_cycle_micro_steps
        accumulation = self.args.gradient_accumulation_steps
        check_step_counter(type(self), step, self.state.global_step, accumulation, cycle)
        prompts = prompts_of(generation_batch)
        if step % cycle == 0 or self._lopti.cycle_prompts is None:
            self._lopti.cycle_prompts = prompts
        elif prompts != self._lopti.cycle_prompts and not self._lopti.warned_prompts:
            # Expected for the rest of a run resumed with ignore_data_skip=True: a warning. Else a stop.
            if not self._lopti.resumed_ignoring_data_skip:
                check_prompts(type(self), step % cycle, cycle, prompts)
            self._lopti.warned_prompts = True
            warn_prompts_changed(step % cycle)

    # ------------------------------------------------------------------------------------------------ loss
    def _compute_loss(self, model, inputs):
        # Evaluation: the base trainer's loss.
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        args = self.args
        token_group = self.lopti_token_group()
        split = self.batch_split(inputs)
        # Under Lopti every micro-batch carries its generation's split: its pi_old is not the policy of this pass.
        if token_group is not None:
            check_split_carried(type(self), split is not None)
        loss_inputs = inputs
        reweights_gradients = args.advantage_reweighting_enabled
        if reweights_gradients and self._lopti.advantage_reweighting_form == "advantages":
            if split is not None:
                # A'(i, t) = w(i, t) * A(i): token-level advantages, which TRL's own loss accepts (fact G1).
                loss_inputs = dict(inputs)
                advantages = token_level_advantages(inputs["advantages"], split.ar_weights.size(1))
                loss_inputs["advantages"] = advantages * split.ar_weights
                reweights_gradients = False
            elif self.beta != 0.0:
                raise ValueError(
                    f"{type(self).__name__}: a batch without old_per_token_logps reached the loss with "
                    f"advantage_reweighting_alpha={args.advantage_reweighting_alpha:g} and beta={self.beta:g}: AR's "
                    "token-level advantages need pi_old before the loss runs, and its general form would reweight the "
                    "KL term. Train through trainer.train(), or put old_per_token_logps in the batch"
                )
        scope = LossScope(
            model=model,
            batch=inputs,
            token_group=token_group,
            trains_aux_loss=token_group in (None, args.lopti_pass_order[0]),
            reweights_gradients=reweights_gradients,
            split=split,
        )
        # A loss call inside another (a user's loss that calls TRL's) gets its own scope, then gives the outer one back.
        outer_scope = self._lopti.loss_scope
        self._lopti.loss_scope = scope
        try:
            loss = super()._compute_loss(model, loss_inputs)
        finally:
            self._lopti.loss_scope = outer_scope
        check_policy_forward(type(self), scope.policy_forwards)
        # On-policy AR alone: the split of this call's pi_old, the loss forward's, is this micro-batch's share of
        # the metrics.
        if split is None and scope.split is not None:
            self._log_split(scope.split, loss_token_mask(inputs), UNSPLIT_REPORTING_THRESHOLD)
        if token_group is not None:
            self._log_pass_loss(token_group, loss.detach())
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        output = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        if self._lopti.scoring_logps is not None:
            self._lopti.scoring_logps.append(output[0])
            return output
        scope = self._lopti.loss_scope
        # Only the policy forward of a training loss, over the loss's rows, carries the method.
        if scope is None or model is not scope.model or not torch.is_grad_enabled():
            return output
        if input_ids.size(0) != scope.batch["completion_ids"].size(0):
            return output
        check_forward_output(type(self), output)
        per_token_logps, entropies, aux_loss = output
        scope.policy_forwards += 1
        loss_mask = loss_token_mask(scope.batch)
        if scope.split is None and scope.reweights_gradients:
            # On-policy AR alone (under Lopti every batch carries its split): this forward's detached output is
            # pi_old, for this call only; eta only reports the low-token share.
            old_per_token_logps = per_token_logps.detach()
            scope.split = self.split_tokens(scope.batch, old_per_token_logps, UNSPLIT_REPORTING_THRESHOLD)
        if scope.reweights_gradients:
            per_token_logps = reweight_token_gradients(per_token_logps, scope.split.ar_weights)
        # Lopti: gradient only through the pass's active tokens.
        if scope.token_group is not None:
            active_mask = token_group_mask(scope.split.low_mask, loss_mask, scope.token_group)
            per_token_logps = isolate_token_gradients(per_token_logps, active_mask)
            if entropies is not None:
                entropies = isolate_token_gradients(entropies, active_mask)
            if aux_loss is not None and not scope.trains_aux_loss:
                aux_loss = aux_loss.detach()
        # Fact S4: what reaches tokens outside the loss mask, added up in the backward, read before the optimizer step.
        if per_token_logps.requires_grad:
            per_token_logps.register_hook(lambda gradient: self._add_gradient_outside_the_mask(loss_mask, gradient))
        return per_token_logps, entropies, aux_loss

    def _add_gradient_outside_the_mask(self, loss_mask: torch.Tensor, gradient: torch.Tensor) -> None:
        """A tensor hook on the log-probabilities handed to the loss: adds up, on the device, the gradient that
        reached tokens outside the loss mask (fact S4)."""
        outside = (gradient.abs() * (1 - loss_mask.to(gradient.dtype))).sum()
        if self._lopti.gradient_outside_the_mask is not None:
            outside = outside + self._lopti.gradient_outside_the_mask
        self._lopti.gradient_outside_the_mask = outside

    def _check_loss_mask_before_the_optimizer_step(self) -> None:
        """Fact S4, on every process before every optimizer step ([`LossMaskCheck`]): no gradient reached tokens
        outside the loss mask on any process since the last step. Every process stops together."""
        outside = self._lopti.gradient_outside_the_mask
        if outside is None:
            outside = torch.zeros((), device=self.accelerator.device)
        self._lopti.gradient_outside_the_mask = None
        check_loss_mask(type(self), float(self.accelerator.reduce(outside.float(), reduction="sum")))

    # ------------------------------------------------------------------------------------------------ metrics
    def _log_split(self, split: TokenSplit, loss_mask: torch.Tensor, eta: float) -> None:
        """Logs the split of a whole generation batch, from this process's part of it; on-policy with AR alone, that
        of a micro-batch (its pi_old is known only at its loss)."""
        mode = "train" if self.model.training else "eval"
        mask = loss_mask.float()
        weights = split.ar_weights if split.ar_weights is not None else torch.ones_like(mask)
        low_tokens = (split.low_mask.float() * mask).sum()
        ar_weight_sum = (weights.float() * mask).sum()
        low_tokens = self.accelerator.reduce(low_tokens, reduction="sum")
        ar_weight_sum = self.accelerator.reduce(ar_weight_sum, reduction="sum")
        tokens = self.accelerator.reduce(mask.sum(), reduction="sum")
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
            {
                key: value.to(device) if torch.is_tensor(value) and key != ETA_KEY else value
                for key, value in batch.items()
            }
            for batch in stored["micro_batches"]
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


def check_generation_step(trainer_class: type, step: int, cycle: int) -> None:
    """Fact S1: TRL generates a training batch only at a cycle's first micro-step (`step` a multiple of the
    `cycle` micro-steps a generation batch is trained for), so that both passes train the batch that was split."""
    if step % cycle:
        saw = (
            f"TRL generated a new batch at micro-step {step % cycle} of a Lopti cycle ({cycle} micro-steps per "
            "generation batch), so a pass would train other completions than the batch that was split"
        )
        raise trl_contract.broken_fact(trl_contract.SCHEDULE, saw, trainer_class)


def check_split_carried(trainer_class: type, carried: bool) -> None:
    """Fact S1, at a training loss under Lopti: the micro-batch carries the split (or the pi_old) of its generation
    batch, as every tensor of that batch is split into TRL's buffered micro-batches."""
    if not carried:
        saw = (
            "a micro-batch reached the loss without the split its generation stored (lopti_low_mask) or pi_old "
            "(old_per_token_logps), so its pass would split against a policy that has already moved"
        )
        raise trl_contract.broken_fact(trl_contract.SCHEDULE, saw, trainer_class)


def check_policy_forward(trainer_class: type, policy_forwards: int) -> None:
    """Fact S2, after a training loss: it ran the log-prob forward of the model it received, with gradient
    (`policy_forwards` times)."""
    if policy_forwards == 0:
        saw = (
            "the loss never ran self._get_per_token_logps_and_entropies on the model it received with gradient, so its "
            "gradient bypasses the log-probabilities that AR and Lopti act on"
        )
        raise trl_contract.broken_fact(trl_contract.LOSS_FORWARD, saw, trainer_class)


def check_loss_mask(trainer_class: type, gradient_outside_the_mask: float) -> None:
    """Fact S4, before an optimizer step: the gradient that reached tokens outside the loss mask (which belong to
    neither Lopti group), summed over every process, is zero."""
    if gradient_outside_the_mask != 0:
        saw = f"a gradient of {gradient_outside_the_mask:.3g} reached tokens outside the loss mask"
        raise trl_contract.broken_fact(trl_contract.LOSS_MASK, saw, trainer_class)


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
