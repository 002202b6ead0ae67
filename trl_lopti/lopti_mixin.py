"""The Lopti mechanism, written once for both trainers: the two-pass schedule, the split, token isolation, the pass
metrics, the completions table, checkpoints inside a generation batch, and the runtime checks of the TRL facts.

[`LoptiTrainerMixin`] sits in front of a TRL trainer (`GRPOTrainer` or `RLOOTrainer`, which TRL keeps in parity). Each
Lopti trainer adds only what differs: where pi_old comes from, how AR enters its loss, and the TRL facts it relies on
(`trl_lopti/grpo_trainer.py` for GRPO, `trl_lopti/rloo_trainer.py` for RLOO). The math is in `trl_lopti/core_algos.py`.

- Schedule. TRL runs the passes itself (docs/trainers/grpo.md, "The Lopti schedule"): `self.num_iterations`, TRL's
  count of the times a generation batch is trained, is the user's `num_iterations` times the passes, so TRL's sampler
  serves each generation batch once per pass and its `_prepare_inputs` replays the buffered micro-batches in each
  (facts S1, S2); TRL sees the user's value at generation, where it decides whether pi_old is needed (G2). Every
  optimizer step is an ordinary Trainer step; the pass of a micro-step follows from TRL's counter `_step`.
- Split. A generation batch is split once by pi_old (`lopti_low_mask`, with AR its weights `lopti_ar_weights`): at
  generation where pi_old is known there (TRL's, RLOO's, or the quantile rule's forward), which logs its metrics on
  the row of TRL's generation metrics; else (on-policy) each micro-batch at its first loss forward, whose detached
  output is pi_old: no extra forward, and the whole first iteration then fits in one optimizer step. Each generation
  batch gets its eta at generation (`lopti_batch_eta`): the quantile rule needs the whole batch's pi_old first.
- Isolation. In a pass, gradient flows only through the active tokens' log-probabilities and entropies; every value of
  the loss is the base trainer's.
- Checks. Every TRL fact the mechanism relies on (S1-S6, stated in `trl_lopti/trl_contract.py`) is checked while
  training, at no measurable cost, and stops the run at the first step where it fails.

The overrides, and why each stays: `training_step` (marks the micro-step in flight; checks S2-S4, S6), `compute_loss`
(the pass's token group; checks S1, S3 and the values AR placed), `_get_per_token_logps_and_entropies` (the one place
TRL's loss hands out the policy's log-probabilities: split, AR, isolation), `_generate_and_score_completions` (pi_old,
eta and the split of a new batch; TRL's pi_old decision at the user's `num_iterations`), `_save_checkpoint` and
`_load_optimizer_and_scheduler` (a batch's schedule across a checkpoint), `log` (one completions table per generation
batch; checks S5).
"""

import dataclasses
import functools
import glob
import os
import textwrap
import warnings
from typing import Any, ClassVar

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from . import trl_contract  # (checks the TRL version before TRL is imported)


# isort: split
from trl.models.utils import disable_gradient_checkpointing

from .config import LoptiArguments, LoptiRLOOConfig, as_lopti_config
from .core_algos import (
    advantage_reweighting_weights,
    isolate_token_gradients,
    lopti_batch_threshold,
    loss_token_mask,
    low_probability_token_mask,
    token_group_mask,
)
from .utils import temporarily_set, trl_completion_logps


logger = logging.get_logger(__name__)

LOW_MASK_KEY = "lopti_low_mask"  # (B, T) bool, in a split batch: pi_old < eta
AR_WEIGHTS_KEY = "lopti_ar_weights"  # (B, T), with AR: alpha * pi_old + 1 - alpha
ETA_KEY = "lopti_batch_eta"  # 0-dim float64 on the CPU, in each micro-batch of a generation batch under Lopti: its eta
FIRST_TRAINED_KEY = "lopti_first_trained_at"  # int: the micro-step of its cycle at which it was first trained
LOPTI_BATCH_KEYS = (LOW_MASK_KEY, AR_WEIGHTS_KEY, ETA_KEY, FIRST_TRAINED_KEY)  # what the trainers add to TRL's batches
GENERATION_BATCH_FILE = "lopti_generation_batch_rank{}.pt"  # in a checkpoint taken inside a generation batch
UNSPLIT_REPORTING_THRESHOLD = 0.5  # the eta of `lopti/low_token_share` when Lopti is off (the paper's)
EMPTY_GROUP_WARNING_BATCHES = 3  # generation batches after which a group empty in every one of them is warned about


LOPTI_PAPER_CITATION = textwrap.dedent("""\
    @article{yang2025lopti,
        title        = {{Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs}},
        author       = {Zhihe Yang and Xufang Luo and Zilong Wang and Dongqi Han and Zhiyuan He and Dongsheng Li and Yunjian Xu},
        year         = 2025,
        eprint       = {arXiv:2505.12929},
    }""")


def lopti_paper(trl_trainer_class: type) -> dict[str, str]:
    """The model card's paper entry of a Lopti trainer: the Lopti paper, cited beside the TRL trainer's own."""
    return {
        "title": "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs",
        "id": "2505.12929",
        "citation": LOPTI_PAPER_CITATION + "\n\n" + trl_trainer_class._paper["citation"],
    }


@dataclasses.dataclass
class MicroStep:
    """The training micro-step in flight (TRL's `_step`), as `training_step` marks it for the hooks it runs: its
    `position` in its generation batch's cycle, whether its micro-batch is trained for the `first_visit` (first pass,
    first iteration), whether the backward reached the log-probabilities handed to TRL's loss (fact S3) and what
    reached them outside the loss mask (S6)."""

    position: int
    first_visit: bool
    backward_reached_logps: bool = False
    gradient_outside_the_mask: torch.Tensor | float = 0.0

    def mark_backward(self, loss_mask: torch.Tensor, gradient: torch.Tensor) -> None:  # a tensor hook
        self.backward_reached_logps = True
        outside = gradient.abs() * (1 - loss_mask.to(gradient.dtype))  # no host sync: read after the step
        self.gradient_outside_the_mask = self.gradient_outside_the_mask + outside.sum()


@dataclasses.dataclass
class LossCall:
    """
    What one `compute_loss` call shares with the policy forward TRL runs inside it (fact S3).

    Args:
        batch (`dict`): the micro-batch (TRL's buffered dict, which keeps TRL's advantages) and its split.
        loss_inputs (`trl_contract.ReadRecorder`): what TRL's `_compute_loss` reads: a copy of the micro-batch, recording its reads.
        token_group (`str` or `None`): the tokens that carry gradient in this pass (`"low"`, `"high"`; `None`: all).
        trains_aux_loss (`bool`): whether a MoE router's auxiliary loss keeps its gradient (the first pass only).
        micro_step (`MicroStep` or `None`): the training micro-step it belongs to (`None`: a call outside training).
        policy_forwards (`int`): the policy forwards TRL ran in this call so far (exactly one is expected).
        placed (`dict`): the values a trainer placed in `loss_inputs` during the forward, which TRL's loss must read.
    """

    batch: dict[str, Any]
    loss_inputs: trl_contract.ReadRecorder
    token_group: str | None
    trains_aux_loss: bool
    micro_step: MicroStep | None
    policy_forwards: int = 0
    placed: dict[str, Any] = dataclasses.field(default_factory=dict)


class LoptiTrainerMixin:
    """
    Advantage Reweighting and Lopti for a TRL trainer whose schedule, loss hooks and checkpoint hooks are
    `GRPOTrainer`'s (facts S1-S6): the base of [`LoptiGRPOTrainer`] and [`LoptiRLOOTrainer`].

    A Lopti trainer sets `config_class` and `trl_trainer_class`, and implements where pi_old comes from
    (`old_per_token_logps_at_generation`) and how AR enters its loss (`apply_advantage_reweighting`).
    """

    config_class: ClassVar[type]  # the trainer's Lopti config (a `LoptiArguments`)
    trl_trainer_class: ClassVar[type]  # the TRL trainer it extends
    loss_is_scaled_for_accumulation: ClassVar[bool]  # whether TRL's loss of a micro-step is divided by accumulation
    placement_fact: ClassVar[str] = "S3"  # the fact by which TRL's loss reads what AR places in its inputs

    def __init__(self, model, reward_funcs=None, args=None, *extra_args, **kwargs):
        args = as_lopti_config(args, model, self.config_class)
        trl_contract.require_verified_contract()  # an untested TRL release trains once `trl-lopti check` passed here
        super().__init__(model, reward_funcs, args, *extra_args, **kwargs)
        # Facts S1, S2: TRL trains each generation batch `self.num_iterations` times, once per pass here
        self.num_iterations = args.num_iterations * args.lopti_num_passes
        self._name = describe_method(args)
        self._micro_step: MicroStep | None = None  # the training micro-step in flight
        self._loss_call: LossCall | None = None  # the compute_loss call in flight
        # while TRL scores a generation batch: the log-probabilities of each forward it runs meanwhile, in order
        self._generation_logps: list[torch.Tensor] | None = None
        self._split_totals: torch.Tensor | None = None  # low tokens, AR weights, tokens of the micro-batches split
        self._cycle_prompts: list[Any] | None = None  # the prompts the dataloader serves through this cycle (S2)
        self._completions_logged_for: int | None = None  # the generation batch whose completions table was written
        self._empty_groups: list[str | None] | None = []  # per batch, until warned: the group it left empty, if any
        if args.lopti_enabled:
            steps = args.lopti_cycle_micro_steps // args.gradient_accumulation_steps
            logger.info(
                f"{type(self).__name__}: Lopti trains each generation batch once per token group ({steps} optimizer "
                f"steps per batch, {steps // 2} without Lopti): max_steps, save_steps, logging_steps and the "
                "learning-rate schedule count both passes, and a max_steps buys half the rollouts it buys "
                f"{self.trl_trainer_class.__name__}. Compare runs at equal generation batches."
            )

    # ------------------------------------------------------------------------------------------------ what differs
    def old_per_token_logps_at_generation(
        self, batch: dict[str, Any], generation_logps: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """
        Where pi_old comes from: pi_old of a generation batch as TRL computed it while scoring it.

        Args:
            batch (`dict`): this process's part of the generation batch, as TRL returned it.
            generation_logps (`list[torch.Tensor]`): the log-probabilities of the forwards TRL ran while scoring it.

        Returns:
            `torch.Tensor` or `None`: pi_old (B, T), or `None` where TRL computed none (on-policy: the first loss
            forward of each micro-batch then gives it).
        """
        raise NotImplementedError

    def apply_advantage_reweighting(self, call: LossCall, per_token_logps: torch.Tensor) -> torch.Tensor:
        """
        Makes TRL's loss reweight each token's advantage by its AR weight (`call.batch[AR_WEIGHTS_KEY]`).

        Args:
            call (`LossCall`): the loss call in flight; a value the loss must read is placed with `place_loss_input`.
            per_token_logps (`torch.Tensor`): the policy's log-probabilities (B, T) of this forward.

        Returns:
            `torch.Tensor`: the log-probabilities TRL's loss reads.
        """
        raise NotImplementedError

    def place_loss_input(self, call: LossCall, key: str, value: Any) -> None:
        """Puts `value` under `key` in what TRL's loss reads, during its forward; the loss must then read it
        (checked after the loss under `placement_fact`)."""
        call.loss_inputs[key] = call.placed[key] = value

    # ------------------------------------------------------------------------------------------------ schedule
    def lopti_pass_index(self) -> int:
        """The pass over its generation batch of the current training micro-step (0 without Lopti)."""
        return (self._step % self.args.lopti_cycle_micro_steps) // self.args.lopti_pass_micro_steps

    def training_step(self, model, inputs, num_items_in_batch=None):
        args, step = self.args, self._step
        cycle = args.lopti_cycle_micro_steps
        prompts = trl_contract.prompts_of(inputs)
        if step % cycle == 0 or self._cycle_prompts is None:
            self._cycle_prompts = prompts
        accumulation = args.gradient_accumulation_steps
        trl_contract.check_micro_step(step, self.state.global_step, accumulation, cycle, prompts, self._cycle_prompts)
        micro_step = MicroStep(position=step % cycle, first_visit=step % cycle < args.steps_per_generation)
        with temporarily_set(self, _micro_step=micro_step):
            output = super().training_step(model, inputs, num_items_in_batch)
        trl_contract.check_backward(micro_step.backward_reached_logps, float(micro_step.gradient_outside_the_mask))
        return output

    # ------------------------------------------------------------------------------------------------ generation batch
    def _generate_and_score_completions(self, inputs):
        if self.model.training:
            trl_contract.check_generation(
                self._step % self.args.lopti_cycle_micro_steps, self.args.lopti_cycle_micro_steps
            )
        self._generation_logps = []
        try:  # fact G2: TRL decides whether it needs pi_old by the user's num_iterations
            with temporarily_set(self, num_iterations=self.args.num_iterations):
                output = super()._generate_and_score_completions(inputs)
            old_per_token_logps = self.old_per_token_logps_at_generation(output, self._generation_logps)
        finally:
            self._generation_logps = None
        if old_per_token_logps is not None:
            output["old_per_token_logps"] = old_per_token_logps
        if self.args.lopti_enabled:
            # a 0-dim float64 tensor on the CPU (MPS has no float64), copied to each micro-batch
            output[ETA_KEY] = torch.tensor(self.lopti_eta(output), dtype=torch.float64)
        if output.get("old_per_token_logps") is not None:  # pi_old known: the whole batch is split now
            self._log_split(*self._split(output, output["old_per_token_logps"]))
        return output

    def lopti_eta(self, batch: dict[str, Any]) -> float:
        """
        eta of a generation batch: `lopti_threshold`, or the `lopti_quantile` quantile of pi_old over the whole batch
        (every process). Override it to split otherwise.

        Args:
            batch (`dict`): this process's part of the generation batch, as TRL generated it.

        Returns:
            `float`: eta in [0, 1].
        """
        if self.args.lopti_quantile is None:
            return self.args.lopti_threshold
        if batch.get("old_per_token_logps") is None:  # TRL did not need it: one no-grad forward, as TRL's own
            args = self.args
            batch_size = args.per_device_train_batch_size if self.model.training else args.per_device_eval_batch_size
            with torch.no_grad(), disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs):
                batch["old_per_token_logps"] = trl_completion_logps(self, batch, batch_size=batch_size)[0]
        local = batch["old_per_token_logps"][loss_token_mask(batch).bool()]
        logps = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0))
        counted = self.accelerator.gather(self.accelerator.pad_across_processes(torch.ones_like(local), dim=0))
        return lopti_batch_threshold(logps, counted, self.args.lopti_quantile)

    # ------------------------------------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = self.model.training
        pass_index = self.lopti_pass_index() if training else 0
        token_group = self.args.lopti_pass_order[pass_index] if training else None
        micro_step = self._micro_step if training else None
        if micro_step is not None:  # fact S1: a later visit trains the micro-batch the first one trained
            first_position = micro_step.position % self.args.steps_per_generation
            expected = None if micro_step.first_visit else first_position
            trl_contract.check_micro_batch(micro_step.position, expected, inputs.get(FIRST_TRAINED_KEY))
            inputs[FIRST_TRAINED_KEY] = first_position
        call = LossCall(inputs, trl_contract.ReadRecorder(inputs), token_group, pass_index == 0, micro_step)
        with temporarily_set(self, _loss_call=call):
            loss = super().compute_loss(model, call.loss_inputs, return_outputs, num_items_in_batch)
        trl_contract.check_loss_call(call.policy_forwards, call.placed, call.loss_inputs.reads, self.placement_fact)
        if token_group is not None:
            self._log_pass_loss(token_group, loss.detach())
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        output = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        trl_contract.check_forward_output(output)
        per_token_logps, entropies, aux_loss = output
        call = self._loss_call
        if call is None:  # a forward outside the loss: pi_old or the reference model's log-probs
            if self._generation_logps is not None:
                self._generation_logps.append(per_token_logps)
            return per_token_logps, entropies, aux_loss
        call.policy_forwards += 1
        if LOW_MASK_KEY not in call.batch:  # pi_old was not known at generation: this forward's output is pi_old
            self._split_at_first_forward(call, per_token_logps.detach())
        if self.args.advantage_reweighting_enabled:
            per_token_logps = self.apply_advantage_reweighting(call, per_token_logps)
        if call.token_group is not None:  # Lopti: gradient only through the pass's active tokens
            active_mask = token_group_mask(call.batch[LOW_MASK_KEY], loss_token_mask(call.batch), call.token_group)
            per_token_logps = isolate_token_gradients(per_token_logps, active_mask)
            if entropies is not None:
                entropies = isolate_token_gradients(entropies, active_mask)
            if aux_loss is not None and not call.trains_aux_loss:
                aux_loss = aux_loss.detach()
        if call.micro_step is not None and per_token_logps.requires_grad:  # facts S3, S6: checked in the backward
            mark = functools.partial(call.micro_step.mark_backward, loss_token_mask(call.batch))
            per_token_logps.register_hook(mark)
        return per_token_logps, entropies, aux_loss

    # ------------------------------------------------------------------------------------------------ split
    def _split_eta(self, batch: dict[str, Any]) -> float:
        """The eta `batch` is split at: its generation's (`ETA_KEY`), else the fixed eta; 0.5 for reporting only."""
        if not self.args.lopti_enabled:
            return UNSPLIT_REPORTING_THRESHOLD
        if ETA_KEY not in batch and self.args.lopti_quantile is not None:
            raise RuntimeError(f"lopti_quantile: this batch has no eta from its generation ({ETA_KEY})")
        return float(batch.get(ETA_KEY, self.args.lopti_threshold))

    def _split(self, batch: dict[str, Any], old_per_token_logps: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Splits `batch` (a generation batch or a micro-batch) by its pi_old: its low mask and, with AR, its AR
        weights; returns its totals (low tokens, AR weight sum, tokens) and the eta it was split at."""
        alpha, eta = self.args.advantage_reweighting_alpha, self._split_eta(batch)
        mask = loss_token_mask(batch)
        low_mask = batch[LOW_MASK_KEY] = low_probability_token_mask(old_per_token_logps, mask, eta)
        weights = advantage_reweighting_weights(old_per_token_logps, alpha)
        if self.args.advantage_reweighting_enabled:
            batch[AR_WEIGHTS_KEY] = weights
        mask = mask.float()
        return torch.stack([(low_mask.float() * mask).sum(), (weights.float() * mask).sum(), mask.sum()]), eta

    def _split_at_first_forward(self, call: LossCall, forward_logps: torch.Tensor) -> None:
        """Splits a micro-batch at its first loss forward, where pi_old is the batch's or, on-policy, that forward's
        detached output; logs the split once the generation batch's last micro-batch is split."""
        batch, micro_step = call.batch, call.micro_step
        old_per_token_logps = batch.get("old_per_token_logps")
        if old_per_token_logps is None:  # on-policy: pi_old is this forward's output
            if micro_step is not None:
                trl_contract.check_on_policy(self._step, micro_step.position, self.args.gradient_accumulation_steps)
            old_per_token_logps = forward_logps
            if self.args.lopti_enabled:  # a later pass's ratio is against it
                batch["old_per_token_logps"] = old_per_token_logps
        totals, eta = self._split(batch, old_per_token_logps)
        if not self.model.training:  # an evaluation batch is its own generation batch
            self._log_split(totals, eta)
            return
        position = self._step % self.args.steps_per_generation
        self._split_totals = totals if position == 0 or self._split_totals is None else self._split_totals + totals
        if position == self.args.steps_per_generation - 1:
            self._log_split(self._split_totals, eta)
            self._split_totals = None

    # ------------------------------------------------------------------------------------------------ metrics
    def _log_split(self, totals: torch.Tensor, eta: float) -> None:
        """Logs the split of a whole generation batch (`totals` of this process: low tokens, AR weights, tokens)."""
        mode = "train" if self.model.training else "eval"
        totals = self.accelerator.reduce(totals, reduction="sum")
        if totals[2] == 0:  # no completion token anywhere: nothing to report
            return
        self._metrics[mode]["lopti/low_token_share"].append((totals[0] / totals[2]).item())
        if self.args.advantage_reweighting_enabled:
            self._metrics[mode]["lopti/ar_weight_mean"].append((totals[1] / totals[2]).item())
        if self.args.lopti_enabled:
            self._metrics[mode]["lopti/threshold"].append(eta)
            if mode == "train":
                self._warn_if_a_group_stays_empty(int(totals[0]), int(totals[2]), eta)

    def _warn_if_a_group_stays_empty(self, low_tokens: int, tokens: int, eta: float) -> None:
        if self._empty_groups is None:  # warned, or a batch has split
            return
        self._empty_groups.append("low" if low_tokens == 0 else "high" if low_tokens == tokens else None)
        if len(self._empty_groups) == EMPTY_GROUP_WARNING_BATCHES:
            empty = self._empty_groups[0] if len(set(self._empty_groups)) == 1 else None
            self._empty_groups = None
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

    def _log_pass_loss(self, token_group: str, loss: torch.Tensor) -> None:  # on its optimizer step's scale
        scale = self.current_gradient_accumulation_steps if self.loss_is_scaled_for_accumulation else 1
        value = self.accelerator.gather((loss * scale).reshape(1)).mean().item()
        self._metrics["train"][f"lopti/loss_{token_group}_pass"].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # TRL writes the completions table at every log (S5); a generation batch's once, however many steps it trains
        mode = "train" if self.model.training else "eval"
        batch_index = (self._step - 1) // self.args.lopti_cycle_micro_steps if mode == "train" else None
        suppressed = self.log_completions and batch_index is not None and batch_index == self._completions_logged_for
        completions = trl_contract.ReadRecorder(self._logs)
        with temporarily_set(self, log_completions=self.log_completions and not suppressed, _logs=completions):
            if self.log_completions and batch_index is not None:
                self._completions_logged_for = batch_index
            super().log(logs, start_time)
        trl_contract.check_log(sorted(self._metrics[mode]), suppressed and bool(completions.reads))

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
            "advantage_reweighting_alpha": args.advantage_reweighting_alpha,  # the saved batch holds its AR weights
        }

    def _save_checkpoint(self, model, trial):
        if self._step % self.args.lopti_cycle_micro_steps != 0 and self._buffered_inputs is not None:
            # inside a generation batch's schedule: keep it and its split for the rest (fact S4), before it is pushed
            checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # the folder transformers saves to
            folder = os.path.join(self._get_output_dir(trial=trial), checkpoint)
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, GENERATION_BATCH_FILE.format(self.accelerator.process_index))
            torch.save({"micro_batches": self._buffered_inputs, "schedule": self._schedule_signature()}, path)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        saved = glob.glob(os.path.join(checkpoint, GENERATION_BATCH_FILE.format("*"))) if checkpoint else []
        schedule = self._schedule_signature()
        path = os.path.join(checkpoint or "", GENERATION_BATCH_FILE.format(self.accelerator.process_index))
        if saved and not os.path.exists(path):  # each process resumes its own part of the batch
            raise resume_error(checkpoint, {"num_processes": len(saved)}, schedule)
        super()._load_optimizer_and_scheduler(checkpoint)
        accumulation, cycle = self.args.gradient_accumulation_steps, self.args.lopti_cycle_micro_steps
        if checkpoint and not saved and cycle % accumulation == 0 and self.state.global_step * accumulation % cycle:
            raise ValueError(  # a boundary of the schedule it was saved with, not of this run's
                f"{checkpoint} holds no generation batch, yet lies inside one of this run's schedule, {schedule}: "
                "resume it with the schedule it was saved with, or from a checkpoint between this one's batches"
            )
        if not saved:
            return
        stored = torch.load(path, map_location="cpu")  # onto the device below: eta stays on the CPU in float64
        if stored["schedule"] != schedule:
            raise resume_error(checkpoint, stored["schedule"], schedule)
        trl_contract.check_resumed_state(self.state.global_step)
        device = self.accelerator.device
        self._buffered_inputs = [  # resume inside the batch's schedule, at the micro-step it stopped at
            {key: value.to(device) if torch.is_tensor(value) and key != ETA_KEY else value for key, value in b.items()}
            for b in stored["micro_batches"]
        ]
        self._step = self.state.global_step * self.args.gradient_accumulation_steps


def resume_error(checkpoint: str, saved: dict[str, Any], current: dict[str, Any]) -> ValueError:
    """The error for a checkpoint taken inside a generation batch with a schedule (`saved`) the run (`current`) lacks."""
    differ = [key for key in saved if saved[key] != current.get(key)]
    return ValueError(
        f"{checkpoint} was saved inside a generation batch with {', '.join(f'{k}={saved[k]}' for k in differ)}; this "
        f"run has {', '.join(f'{k}={current.get(k)}' for k in differ)}: resume it with the values it was saved with, or "
        "from a checkpoint between generation batches"
    )


def describe_method(config: LoptiArguments) -> str:
    """The method of a configuration in words, the model card's "trained with", e.g. `"GRPO with Advantage
    Reweighting (alpha=0.3) and Low-Probability Token Isolation (Lopti, eta=0.5, low tokens first)"`."""
    base = "RLOO" if isinstance(config, LoptiRLOOConfig) else "GRPO"  # (a user's subclass of either too)
    base = "REINFORCE++" if getattr(config, "advantage_estimator", None) == "reinforce_plus_plus" else base
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
