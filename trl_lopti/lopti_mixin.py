"""The Lopti mechanism, written once for both trainers: the two-pass schedule, the split, token isolation, the pass
metrics, the completions table and checkpoints inside a generation batch.

[`LoptiTrainerMixin`] sits in front of a TRL trainer (`GRPOTrainer` or `RLOOTrainer`, which TRL keeps in parity). Each
Lopti trainer adds only what differs: where pi_old comes from, how AR enters its loss, and the TRL facts it relies on
(`trl_lopti/trainer.py` for GRPO, `trl_lopti/rloo_trainer.py` for RLOO). The math is in `trl_lopti/core_algos.py`.

- Schedule. Each generation batch is trained once per pass (docs/trainers/grpo.md, "The Lopti schedule"): the first pass is TRL's own
  schedule, a later pass replays the micro-batches TRL buffered, so every optimizer step is an ordinary Trainer step.
- Split. Each micro-batch is split once, at its first loss forward, into its own dict (`lopti_low_mask`, AR's values,
  with Lopti `old_per_token_logps`): pi_old is the batch's (the trainer's source), else that forward's detached output
  (on-policy: no extra forward). Each generation batch gets its eta at generation (`lopti_batch_eta`): the quantile
  rule needs the whole batch's pi_old first.
- Isolation. In a pass, gradient flows only through the active tokens' log-probabilities and entropies; every value of
  the loss is the base trainer's.

The TRL facts it relies on hold for both `GRPOTrainer` and `RLOOTrainer` (TRL 1.10-1.16); their numbers are the ones
`trl_lopti/_compat.py` (`TRL_FACTS`), the docs and `tests/test_trl_contract.py` use:

- S1. Schedule. `_prepare_inputs` generates when `self._step % (steps_per_generation * num_iterations) == 0`, buffers
  the batch split into micro-batches in `self._buffered_inputs` (0-dim tensors copied into each) and serves slice
  `self._step % steps_per_generation`; `training_step` then increments `self._step`.
- S2. Dataloader. The train dataloader repeats each generation batch `self.num_iterations * steps_per_generation`
  times, reading `self.num_iterations` as it is built.
- S3. Loss forward. `_compute_loss(model, inputs)` calls `self._get_per_token_logps_and_entropies` once for the
  policy, and that method takes `batch_size=` and the same arguments in both trainers.
- S4. Checkpoints. `_save_checkpoint` and `_load_optimizer_and_scheduler` are the extension points for trainer state
  (TRL's entropy controller uses them); transformers calls the latter on resume after `self.state` is loaded.
- S5. Logging. `log` averages the lists in `self._metrics[mode]` and writes the completions table when
  `self.log_completions` is true at that call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import inspect
import os
import textwrap
from typing import Any, ClassVar

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import _compat  # noqa: F401  (checks the TRL version before TRL is imported)


# isort: split
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from .config import LoptiArguments, as_lopti_config
from .core_algos import (
    advantage_reweighting_weights,
    isolate_token_gradients,
    lopti_batch_threshold,
    loss_token_mask,
    low_probability_token_mask,
    token_group_mask,
)


LOW_MASK_KEY = "lopti_low_mask"  # (B, T) bool, in each micro-batch: the split, pi_old < eta
AR_ADVANTAGES_KEY = "lopti_advantages"  # (B, T), GRPO with AR: the token-level advantages TRL's loss reads
AR_WEIGHTS_KEY = "lopti_ar_weights"  # (B, T), RLOO with AR: the weight of the gradient through each token
ETA_KEY = "lopti_batch_eta"  # 0-dim, in each micro-batch of a generation batch under Lopti: its eta
LOPTI_BATCH_KEYS = (LOW_MASK_KEY, AR_ADVANTAGES_KEY, AR_WEIGHTS_KEY, ETA_KEY)  # what the trainers add to TRL's batches
GENERATION_BATCH_FILE = "lopti_generation_batch_rank{}.pt"  # in a checkpoint taken inside a generation batch
UNSPLIT_REPORTING_THRESHOLD = 0.5  # the eta of `lopti/low_token_share` when Lopti is off (the paper's)
# The multimodal inputs of TRL's log-prob forward (its other arguments are ids, masks and options), as TRL names them
# (TRL 1.14's GRPOTrainer takes them as `**kwargs` there and passes them on to `_full_logits_logps`, which names them).
_NAMED_FORWARD = getattr(GRPOTrainer, "_full_logits_logps", GRPOTrainer._get_per_token_logps_and_entropies)
EXTRA_FORWARD_KEYS = tuple(
    name
    for name, parameter in inspect.signature(_NAMED_FORWARD).parameters.items()
    if parameter.default is None and name != "batch_size"
)

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
class LossCall:
    """What one `compute_loss` call shares with the policy forward TRL runs inside it (fact S3).

    Args:
        batch (`dict`): the micro-batch (TRL's buffered dict, which keeps TRL's advantages) and its split.
        loss_inputs (`dict`): what TRL's `_compute_loss` reads: a copy of the micro-batch, AR's values in it for GRPO.
        token_group (`str` or `None`): the tokens that carry gradient in this pass (`"low"`, `"high"`; `None`: all).
        trains_aux_loss (`bool`): whether a MoE router's auxiliary loss keeps its gradient (the first pass only).
        policy_forwards (`int`): the policy forwards TRL ran in this call so far (exactly one is expected).
    """

    batch: dict[str, Any]
    loss_inputs: dict[str, Any]
    token_group: str | None
    trains_aux_loss: bool
    policy_forwards: int = 0


class LoptiTrainerMixin:
    """
    Advantage Reweighting and Lopti for a TRL trainer whose schedule, loss hooks and checkpoint hooks are
    `GRPOTrainer`'s (facts S1-S5): the base of [`LoptiGRPOTrainer`] and [`LoptiRLOOTrainer`].

    A Lopti trainer sets `config_class` and `trl_trainer_class`, and implements where pi_old comes from
    (`old_per_token_logps_at_generation`) and how AR enters its loss (`store_advantage_reweighting`,
    `apply_advantage_reweighting`).
    """

    config_class: ClassVar[type]  # the trainer's Lopti config (a `LoptiArguments`)
    trl_trainer_class: ClassVar[type]  # the TRL trainer it extends
    loss_is_scaled_for_accumulation: ClassVar[bool]  # whether TRL's loss of a micro-step is divided by accumulation

    def __init__(self, model, reward_funcs=None, args=None, *extra_args, **kwargs):
        args = as_lopti_config(args, model, self.config_class)
        super().__init__(model, reward_funcs, args, *extra_args, **kwargs)
        self._name = describe_method(args)
        self._loss_call: LossCall | None = None  # the compute_loss call in flight
        # while TRL scores a generation batch: the log-probabilities of each forward it runs meanwhile, in order
        self._generation_logps: list[torch.Tensor] | None = None
        self._split_totals: torch.Tensor | None = None  # low tokens, AR weights, tokens of the batch split so far
        self._completions_logged_for: int | None = None  # the generation batch whose completions table was written

    # ------------------------------------------------------------------------------------------------ what differs
    def old_per_token_logps_at_generation(
        self, batch: dict[str, Any], generation_logps: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """
        Where pi_old comes from: pi_old (B, T) of a generation batch as TRL computed it while scoring it, or `None`
        where TRL computed none (the first pass's forward then gives it).

        Args:
            batch (`dict`): this process's part of the generation batch, as TRL returned it.
            generation_logps (`list[torch.Tensor]`): the log-probabilities of the forwards TRL ran while scoring it.
        """
        raise NotImplementedError

    def store_advantage_reweighting(self, batch: dict[str, Any], old_per_token_logps: torch.Tensor) -> None:
        """
        How AR enters the loss, part 1: stores AR's values in a micro-batch at its split (when AR is on).

        Args:
            batch (`dict`): the micro-batch (TRL's buffered dict).
            old_per_token_logps (`torch.Tensor`): its pi_old (B, T).
        """
        raise NotImplementedError

    def apply_advantage_reweighting(self, call: LossCall, per_token_logps: torch.Tensor) -> torch.Tensor:
        """
        How AR enters the loss, part 2: in each loss forward of a split micro-batch (when AR is on), returns the
        log-probabilities the loss reads (and may set what it reads in `call.loss_inputs`).

        Args:
            call (`LossCall`): the loss call in flight.
            per_token_logps (`torch.Tensor`): the policy's log-probabilities (B, T) of this forward.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ schedule
    def lopti_pass_index(self) -> int:
        """The pass over its generation batch of the current training micro-step (0 without Lopti)."""
        return (self._step % self.args.lopti_cycle_micro_steps) // self.args.lopti_pass_micro_steps

    def get_train_dataloader(self):
        # Fact S2: the dataloader serves each generation batch `self.num_iterations * steps_per_generation` times;
        # Lopti trains it num_iterations times per pass, so an epoch still covers every prompt once.
        with temporarily_set(self, num_iterations=self.args.lopti_num_passes * self.args.num_iterations):
            return super().get_train_dataloader()

    def _prepare_inputs(self, generation_batch):
        if self.model.training and self.lopti_pass_index() > 0:  # a later pass replays the first pass's micro-batches
            return self._buffered_inputs[self._step % self.args.steps_per_generation]
        return super()._prepare_inputs(generation_batch)

    # ------------------------------------------------------------------------------------------------ generation batch
    def _generate_and_score_completions(self, inputs):
        self._generation_logps = []
        try:
            output = super()._generate_and_score_completions(inputs)
            old_per_token_logps = self.old_per_token_logps_at_generation(output, self._generation_logps)
        finally:
            self._generation_logps = None
        if old_per_token_logps is not None:
            output["old_per_token_logps"] = old_per_token_logps
        if self.args.lopti_enabled:
            # a 0-dim float64 tensor on the CPU (MPS has no float64), copied to each micro-batch
            output[ETA_KEY] = torch.tensor(self.lopti_eta(output), dtype=torch.float64)
        return output

    def lopti_eta(self, batch: dict[str, Any]) -> float:
        """
        eta of a generation batch: `lopti_threshold`, or the `lopti_quantile` quantile of pi_old over the whole batch
        (every process). Override it to split otherwise.

        Args:
            batch (`dict`): this process's part of the generation batch, as TRL generated it.
        """
        if self.args.lopti_quantile is None:
            return self.args.lopti_threshold
        if "old_per_token_logps" not in batch:  # TRL did not need it: one no-grad forward, as TRL's own
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
        call = LossCall(inputs, dict(inputs), token_group, trains_aux_loss=pass_index == 0)
        with temporarily_set(self, _loss_call=call):
            loss = super().compute_loss(model, call.loss_inputs, return_outputs, num_items_in_batch)
        if call.policy_forwards != 1:  # fact S3, checked at every step
            raise RuntimeError(
                f"{self.trl_trainer_class.__name__}._compute_loss ran {call.policy_forwards} policy forwards through "
                "_get_per_token_logps_and_entropies, not one: trl_lopti does not support this TRL"
            )
        if token_group is not None:
            self._log_pass_loss(token_group, loss.detach())
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        per_token_logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        call = self._loss_call
        if call is None:  # a forward outside the loss: pi_old or the reference model's log-probs
            if self._generation_logps is not None:
                self._generation_logps.append(per_token_logps)
            return per_token_logps, entropies, aux_loss
        call.policy_forwards += 1
        if LOW_MASK_KEY not in call.batch:  # the micro-batch's first loss forward: split it
            self._split(call.batch, per_token_logps.detach())
        if self.args.advantage_reweighting_enabled:
            per_token_logps = self.apply_advantage_reweighting(call, per_token_logps)
        if call.token_group is not None:  # Lopti: gradient only through the pass's active tokens
            active_mask = token_group_mask(call.batch[LOW_MASK_KEY], loss_token_mask(call.batch), call.token_group)
            per_token_logps = isolate_token_gradients(per_token_logps, active_mask)
            if entropies is not None:
                entropies = isolate_token_gradients(entropies, active_mask)
            if aux_loss is not None and not call.trains_aux_loss:
                aux_loss = aux_loss.detach()
        return per_token_logps, entropies, aux_loss

    def _split(self, batch: dict[str, Any], forward_logps: torch.Tensor) -> None:
        """Splits a micro-batch once: its low mask, with AR its reweighting, with Lopti its pi_old."""
        old_per_token_logps = batch.get("old_per_token_logps")
        if old_per_token_logps is None:  # on-policy: pi_old is this forward's output
            old_per_token_logps = forward_logps
            if self.args.lopti_enabled:  # a later pass's ratio is against it
                batch["old_per_token_logps"] = old_per_token_logps
        # the generation's eta; the fixed eta for a batch made elsewhere
        eta = batch.get(ETA_KEY, self.args.lopti_threshold)
        if eta is None and self.args.lopti_quantile is not None:
            raise RuntimeError(f"lopti_quantile: this batch has no eta from its generation ({ETA_KEY})")
        eta = float(eta) if self.args.lopti_enabled else UNSPLIT_REPORTING_THRESHOLD
        mask = loss_token_mask(batch)
        low_mask = batch[LOW_MASK_KEY] = low_probability_token_mask(old_per_token_logps, mask, eta)
        mask = mask.float()
        if self.args.advantage_reweighting_enabled:
            self.store_advantage_reweighting(batch, old_per_token_logps)
        alpha = self.args.advantage_reweighting_alpha
        weight_sum = (advantage_reweighting_weights(old_per_token_logps, alpha).float() * mask).sum()
        self._log_split(torch.stack([(low_mask.float() * mask).sum(), weight_sum, mask.sum()]), eta)

    # ------------------------------------------------------------------------------------------------ metrics
    def _log_split(self, micro_batch_totals: torch.Tensor, eta: float) -> None:
        """Logs the split of a generation batch once its last micro-batch is split (first pass, first iteration)."""
        if self.model.training:
            position = self._step % self.args.steps_per_generation
            first = position == 0 or self._split_totals is None
            self._split_totals = micro_batch_totals if first else self._split_totals + micro_batch_totals
            if position != self.args.steps_per_generation - 1:
                return
            micro_batch_totals, self._split_totals = self._split_totals, None
        mode = "train" if self.model.training else "eval"  # an evaluation batch is its own generation batch
        totals = self.accelerator.reduce(micro_batch_totals, reduction="sum")
        if totals[2] == 0:  # no completion token anywhere: nothing to report
            return
        self._metrics[mode]["lopti/low_token_share"].append((totals[0] / totals[2]).item())
        if self.args.advantage_reweighting_enabled:
            self._metrics[mode]["lopti/ar_weight_mean"].append((totals[1] / totals[2]).item())
        if self.args.lopti_enabled:
            self._metrics[mode]["lopti/threshold"].append(eta)

    def _log_pass_loss(self, token_group: str, loss: torch.Tensor) -> None:
        # TRL's loss of a micro-step, on its optimizer step's scale (GRPO returns the micro-step's share of it)
        scale = self.current_gradient_accumulation_steps if self.loss_is_scaled_for_accumulation else 1
        value = self.accelerator.gather((loss * scale).reshape(1)).mean().item()
        self._metrics["train"][f"lopti/loss_{token_group}_pass"].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Fact S5: TRL writes the completions table at every log; a generation batch trained over several optimizer
        # steps (Lopti's passes, steps_per_generation > gradient_accumulation_steps) is written once.
        batch_index = (self._step - 1) // self.args.lopti_cycle_micro_steps if self.model.training else None
        fresh = batch_index is None or batch_index != self._completions_logged_for
        with temporarily_set(self, log_completions=self.log_completions and fresh):
            if self.log_completions and batch_index is not None:
                self._completions_logged_for = batch_index
            super().log(logs, start_time)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        if self._step % self.args.lopti_cycle_micro_steps != 0 and self._buffered_inputs is not None:
            # inside a generation batch's schedule: keep it and its split for the rest (fact S4), before it is pushed
            checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # the folder transformers saves to
            folder = os.path.join(self._get_output_dir(trial=trial), checkpoint)
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, GENERATION_BATCH_FILE.format(self.accelerator.process_index))
            torch.save(self._buffered_inputs, path)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        saved = glob.glob(os.path.join(checkpoint, GENERATION_BATCH_FILE.format("*"))) if checkpoint else []
        if saved and len(saved) != self.accelerator.num_processes:  # each process resumes its own part of the batch
            raise ValueError(
                f"{checkpoint} was saved inside a generation batch by {len(saved)} processes: resume it "
                f"with {len(saved)} processes, or from a checkpoint between generation batches"
            )
        super()._load_optimizer_and_scheduler(checkpoint)
        if saved:  # resume inside the batch's schedule, at the micro-step it stopped at
            device = self.accelerator.device  # torch.load maps to "cpu", not to an indexed "cpu:0"
            path = os.path.join(checkpoint, GENERATION_BATCH_FILE.format(self.accelerator.process_index))
            self._buffered_inputs = torch.load(path, map_location="cpu" if device.type == "cpu" else device)
            self._step = self.state.global_step * self.args.gradient_accumulation_steps


def describe_method(config: LoptiArguments) -> str:
    """The method of a configuration in words, the model card's "trained with", e.g. `"GRPO with Advantage
    Reweighting (alpha=0.3) and Low-Probability Token Isolation (Lopti, eta=0.5, low tokens first)"`."""
    base = {"grpo": "GRPO", "reinforce_plus_plus": "REINFORCE++", "rloo": "RLOO"}[config.advantage_estimator]
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


def trl_completion_logps(trainer, batch: dict[str, Any], model=None, **kwargs: Any) -> tuple:
    """Per-token log-probabilities and entropies (`None` unless `compute_entropy=True`; B x T) of the completions of a
    TRL batch by TRL's own forward (`_get_per_token_logps_and_entropies` of the trainer's TRL class, whatever a subclass
    overrides: its LM head, temperature and autocast; `kwargs` go to it), with gradient where grad mode is on; `model`
    defaults to `trainer.model`."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    extra = {key: batch[key] for key in EXTRA_FORWARD_KEYS if batch.get(key) is not None}
    model, num_tokens = trainer.model if model is None else model, batch["completion_ids"].size(1)
    forward = getattr(trainer, "trl_trainer_class", GRPOTrainer)._get_per_token_logps_and_entropies
    return forward(trainer, model, input_ids, attention_mask, num_tokens, **extra, **kwargs)[:2]


@contextlib.contextmanager
def temporarily_set(obj: Any, **values: Any):
    """Sets instance attributes of `obj` for the block (shadowing those of its class, methods included), then restores
    what the instance held itself."""
    own = {name: vars(obj)[name] for name in values if name in vars(obj)}
    vars(obj).update(values)
    try:
        yield
    finally:
        for name in values:
            del vars(obj)[name]
        vars(obj).update(own)
