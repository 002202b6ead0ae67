"""`LoptiGRPOTrainer`: TRL's `GRPOTrainer` with Advantage Reweighting, Low-Probability Token Isolation and REINFORCE++.

The math is in `trl_lopti/core_algos.py`; this file is plumbing. TRL still computes every loss, KL, clipping,
importance-sampling and normalisation term itself; this trainer changes, per token, the advantage TRL's loss reads
(AR) and through which tokens' log-probabilities and entropies gradient flows in which pass (Lopti).

The facts of a generation batch (pi_old, the batch's eta, the split, the AR advantages) are computed once and kept in
its buffered micro-batches (keys `old_per_token_logps`, `lopti_threshold`, `lopti_low_mask`, `lopti_advantages`); the
passes only read them. Where TRL computes pi_old at generation (off-policy schedules,
vLLM importance sampling, and always with `lopti_quantile`), the split is made there for the whole batch; in on-policy
runs with a fixed eta, pi_old of a micro-batch is the detached output of its first training forward (no extra
forward), and its split is made then.

The TRL 1.16 facts it relies on, each pinned by `tests/test_trl_contract.py` or `tests/test_lopti_split.py`:

1. `GRPOTrainer._compute_loss(model, inputs)` calls `self._get_per_token_logps_and_entropies` exactly once for the
   policy and reads `inputs["advantages"]` and `inputs["old_per_token_logps"]` only afterwards; it accepts
   token-level advantages (B, T). For the duration of one `compute_loss` call, the override of
   `_get_per_token_logps_and_entropies` sees the micro-batch and its pass, and returns log-probabilities and
   entropies whose gradient flows only through the pass's active tokens (Lopti).
2. `GRPOTrainer._prepare_inputs` generates when `self._step % (steps_per_generation * num_iterations) == 0`, buffers
   the split generation batch in `self._buffered_inputs` (0-dim tensors are copied into every micro-batch) and serves
   slice `self._step % steps_per_generation`; `training_step` increments `self._step` after each micro-step. Lopti is
   a schedule over that counter: each generation batch is served once per pass (README, "The Lopti schedule"), the
   first pass through TRL's `_prepare_inputs`, the later ones replaying `self._buffered_inputs`. Every optimizer step
   is an ordinary Trainer step (gradient synchronisation, clipping, scheduler, DeepSpeed and FSDP untouched).
3. The train sampler repeats each generation batch `num_iterations * steps_per_generation` times, read from
   `self.num_iterations` while the dataloader is built; Lopti builds it with one repeat per pass.
4. `_generate_and_score_completions` computes `old_per_token_logps` (a no-grad forward) when
   `gradient_accumulation_steps % (steps_per_generation * self.num_iterations) != 0`, reading `self.num_iterations`
   for nothing else; `lopti_quantile` makes it do so. It calls `_calculate_rewards` once, which returns the rewards
   of the whole generation batch, gathered over processes in process order (REINFORCE++ reads them there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import textwrap
import warnings
from typing import Any

import torch

from . import _compat  # noqa: F401, I001  (checks the TRL version before TRL is imported)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from .config import LoptiGRPOConfig, lopti_pass_ends_on_optimizer_step, lopti_schedule_error
from .core_algos import (
    advantage_reweighting_weights,
    isolate_token_gradients,
    low_probability_token_mask,
    reinforce_plus_plus_advantages,
    reweight_advantages,
    token_group_mask,
)


# Keys this trainer adds to the micro-batches of a generation batch.
LOW_MASK_KEY = "lopti_low_mask"  # (B, T) bool: the split, pi_old < eta
THRESHOLD_KEY = "lopti_threshold"  # 0-dim: the batch's eta
AR_ADVANTAGES_KEY = "lopti_advantages"  # (B, T), with AR: the token-level advantages the loss reads
SPLIT_TOTALS_KEY = "lopti_split_totals"  # (3,): low tokens, AR weight sum, tokens of a micro-batch split on its own
COMPLETIONS_LOGGED_KEY = "lopti_completions_logged"  # on the first micro-batch: its completions table is written

# The threshold for `lopti/low_token_share` when Lopti is off (the paper's eta), so GRPO and AR runs log it too.
UNSPLIT_REPORTING_THRESHOLD = 0.5

LOPTI_PAPER_CITATION = textwrap.dedent("""\
    @article{yang2025lopti,
        title        = {{Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs}},
        author       = {Zhihe Yang and Xufang Luo and Zilong Wang and Dongqi Han and Zhiyuan He and Dongsheng Li and Yunjian Xu},
        year         = 2025,
        eprint       = {arXiv:2505.12929},
    }""")


def as_lopti_config(args: GRPOConfig | None, model: Any) -> LoptiGRPOConfig:
    """
    Returns a `LoptiGRPOConfig` for `args`.

    A `LoptiGRPOConfig` passes through. A plain `GRPOConfig` (a user who only swapped the trainer class) becomes a
    `LoptiGRPOConfig` with the same values and the paper's defaults for the new fields, with a warning that says so.
    `None` gives the defaults, with TRL's naming of the output folder.

    Args:
        args (`GRPOConfig` or `None`):
            The configuration given to the trainer.
        model (`str` or `PreTrainedModel`):
            The model given to the trainer (names the default output folder).

    Returns:
        `LoptiGRPOConfig`: The configuration to train with.
    """
    if isinstance(args, LoptiGRPOConfig):
        return args
    if args is None:
        model_name = model if isinstance(model, str) else model.config._name_or_path
        return LoptiGRPOConfig(output_dir=f"{str(model_name).split('/')[-1]}-Lopti-GRPO")
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be a LoptiGRPOConfig or a GRPOConfig, got {type(args).__name__}")
    if not lopti_pass_ends_on_optimizer_step(args):
        raise ValueError(lopti_schedule_error(args, upgraded_from_grpo_config=True))
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
    # GRPOConfig.__post_init__ filled in generation_batch_size from steps_per_generation; both set is an error.
    values["generation_batch_size"] = None
    defaults = LoptiGRPOConfig
    warnings.warn(
        "LoptiGRPOTrainer got a plain GRPOConfig and turns on the paper's defaults: Advantage Reweighting "
        f"(advantage_reweighting_alpha={defaults.advantage_reweighting_alpha}) and Lopti "
        f"(lopti_threshold={defaults.lopti_threshold}, lopti_order={defaults.lopti_order!r}). Lopti trains each "
        "generation batch twice, so it makes two optimizer steps where GRPO makes one: max_steps, the learning-rate "
        "schedule, save_steps and logging_steps now count twice per generation batch, and max_steps buys half the "
        "rollouts. Pass a trl_lopti.LoptiGRPOConfig to choose these values (lopti_threshold=None and "
        "advantage_reweighting_alpha=0 give plain GRPO).",
        UserWarning,
        stacklevel=3,
    )
    return LoptiGRPOConfig(**values)


class LoptiGRPOTrainer(GRPOTrainer):
    """
    TRL's `GRPOTrainer` with Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti), arXiv 2505.12929.

    Same constructor and arguments as `GRPOTrainer`. `args` should be a [`LoptiGRPOConfig`]; a plain `GRPOConfig`
    is upgraded with the paper's defaults (`advantage_reweighting_alpha=0.3`, `lopti_threshold=0.5`), with a warning.

    - AR replaces each completion's advantage `A(i)` by the token-level `(alpha * pi_old(i, t) + 1 - alpha) * A(i)`.
      The KL penalty is not reweighted.
    - Lopti splits the completion tokens of each generation batch once by `pi_old < eta` (eta: `lopti_threshold`, or
      the `lopti_quantile` quantile of the whole batch's `pi_old`) and trains the batch once per token group: first
      only the low tokens carry gradient, then only the high ones, from the parameters the first pass produced and
      with importance ratios against the same `pi_old`. A pass without an active token is an ordinary optimizer step
      with a zero gradient, as in the authors' runs. In a pass every value
      of the loss is what plain GRPO computes; only the gradient through the inactive tokens' log-probabilities and
      entropies is cut, which isolates the groups for every loss type and importance-sampling level. The router's
      auxiliary loss (MoE models), not a per-token term, gets its gradient in the first pass only.
    - `advantage_estimator="reinforce_plus_plus"` replaces TRL's group-relative advantages by REINFORCE++'s.

    The schedule, its cost and what `max_steps` counts: README, section "The Lopti schedule".

    Logged metrics (prefix `lopti/`), once per generation batch: `lopti/low_token_share` (share of the batch's
    completion tokens with `pi_old < eta`; eta = 0.5 when Lopti is off), `lopti/ar_weight_mean` (mean AR weight over
    them, with AR on), `lopti/threshold` (the batch's eta, with Lopti on); once per pass: `lopti/loss_low_pass`,
    `lopti/loss_high_pass` (TRL's loss, whose value is the plain GRPO loss at the parameters of that pass).
    Completions (`log_completions`) are logged once per generation batch.
    """

    _tag_names = ["trl", "grpo", "lopti"]
    _name = "Lopti-GRPO"
    _paper = {
        "title": "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs",
        "id": "2505.12929",
        "citation": LOPTI_PAPER_CITATION + "\n\n" + GRPOTrainer._paper["citation"],
    }

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *extra_args, **kwargs):
        args = as_lopti_config(args, model)
        super().__init__(model, reward_funcs, args, *extra_args, **kwargs)
        self._name = describe_method(args)
        # What the TRL call now running shares with the hooks it calls, for that call only: while a generation batch
        # is scored, the dict its rewards go into; while a micro-batch's loss is computed, that micro-batch and pass.
        self._call_scope: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------------ schedule
    @property
    def lopti_pass_micro_steps(self) -> int:
        """Micro-steps in one pass: the schedule plain GRPO runs on one generation batch."""
        return self.args.steps_per_generation * self.args.num_iterations

    def lopti_pass_index(self, micro_step: int | None = None) -> int:
        """
        Which pass over its generation batch a training micro-step belongs to.

        Args:
            micro_step (`int` or `None`, *optional*):
                TRL's micro-step counter; defaults to the current one (`self._step`).

        Returns:
            `int`: 0 for the first pass, 1 for the second (always 0 without Lopti).
        """
        micro_step = self._step if micro_step is None else micro_step
        cycle_micro_steps = self.args.lopti_num_passes * self.lopti_pass_micro_steps
        return (micro_step % cycle_micro_steps) // self.lopti_pass_micro_steps

    def lopti_token_group(self) -> str | None:
        """The token group that carries gradient in the current training micro-step (`None` without Lopti)."""
        return self.args.lopti_pass_order[self.lopti_pass_index()]

    def get_train_dataloader(self):
        # One repeat of TRL's schedule per pass: an epoch still covers every prompt once.
        with _temporarily_set(self, "num_iterations", self.args.lopti_num_passes * self.args.num_iterations):
            return super().get_train_dataloader()

    def _prepare_inputs(self, generation_batch):
        if not self.model.training or self.lopti_pass_index() == 0:
            return super()._prepare_inputs(generation_batch)
        # A later pass replays the generation batch of the first (TRL's `_step` keeps counting, so it does not
        # generate here: it generates again at the start of the next cycle).
        buffered = self._buffered_inputs[self._step % self.args.steps_per_generation]
        if LOW_MASK_KEY not in buffered:
            raise RuntimeError("Lopti second pass without the split of its first pass; please report this bug.")
        return buffered

    # ------------------------------------------------------------------------------------------------ generation batch
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._call_scope is not None:
            self._call_scope["rewards_per_func"] = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        # TRL computes pi_old at generation when gradient_accumulation_steps is not a multiple of
        # steps_per_generation * num_iterations: the quantile split needs it for the whole batch before the first pass.
        num_iterations = self.num_iterations
        if self.args.lopti_quantile is not None:
            num_iterations = self.args.gradient_accumulation_steps + 1
        scope: dict[str, Any] = {}
        with _temporarily_set(self, "_call_scope", scope), _temporarily_set(self, "num_iterations", num_iterations):
            output = super()._generate_and_score_completions(inputs)
        if self.args.advantage_estimator == "reinforce_plus_plus":
            output["advantages"] = self._reinforce_plus_plus_advantages(scope["rewards_per_func"], output)
        if "old_per_token_logps" in output:  # pi_old of the whole batch is known: split it now, once
            threshold = self._generation_batch_threshold(output)
            self._log_split_metrics(self._split(output, output["old_per_token_logps"], threshold), threshold)
        elif self.args.lopti_quantile is not None:
            raise RuntimeError(
                "GRPOTrainer._generate_and_score_completions did not compute old_per_token_logps: this TRL version is "
                "not supported by trl_lopti with lopti_quantile."
            )
        return output

    def _reinforce_plus_plus_advantages(self, rewards_per_func: torch.Tensor, output: dict) -> torch.Tensor:
        """REINFORCE++ advantages of this process's completions, whitened over the whole generation batch."""
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # unscorable, as TRL marks them
        lengths = self.accelerator.gather(_loss_mask(output).sum(dim=1))  # process order, as the rewards
        advantages = reinforce_plus_plus_advantages(rewards, lengths)
        # the completions table shows the advantages trained on
        logged = self._logs["advantages"]
        for _ in range(min(len(advantages), len(logged))):
            logged.pop()
        logged.extend(advantages.tolist())
        local = len(output["completion_mask"])
        start = self.accelerator.process_index * local
        return advantages[start : start + local].to(output["completion_mask"].device)

    def _generation_batch_threshold(self, output: dict[str, Any]) -> float:
        """The batch's eta (`LoptiGRPOConfig.lopti_batch_threshold`), over the tokens of every process."""
        if self.args.lopti_quantile is None:
            return self.args.lopti_threshold or UNSPLIT_REPORTING_THRESHOLD
        mask = _loss_mask(output).bool()
        local_logps = output["old_per_token_logps"][mask]
        logps = self.accelerator.gather(self.accelerator.pad_across_processes(local_logps, dim=0))
        counted = self.accelerator.gather(self.accelerator.pad_across_processes(torch.ones_like(local_logps), dim=0))
        return self.args.lopti_batch_threshold(logps, counted)

    def _split(self, batch: dict[str, Any], old_per_token_logps: torch.Tensor, threshold: float) -> torch.Tensor:
        """
        Splits a batch once: writes its low mask, its eta and, with AR, its token-level advantages into `batch`.

        TRL's `advantages` stay as they are (what TRL logged); the loss reads `lopti_advantages` instead.

        Returns:
            `torch.Tensor`: The sums the batch metrics need: low tokens, AR weights (0 without AR), tokens.
        """
        mask = _loss_mask(batch)
        low_mask = low_probability_token_mask(old_per_token_logps, mask, threshold)
        batch[LOW_MASK_KEY] = low_mask
        batch[THRESHOLD_KEY] = torch.tensor(threshold, device=mask.device)
        mask = mask.float()
        weight_sum = mask.new_zeros(())
        if self.args.advantage_reweighting_enabled:  # A'(i, t) = (alpha * pi_old(i, t) + 1 - alpha) * A(i)
            alpha = self.args.advantage_reweighting_alpha
            batch[AR_ADVANTAGES_KEY] = reweight_advantages(batch["advantages"], old_per_token_logps, alpha)
            weight_sum = (advantage_reweighting_weights(old_per_token_logps, alpha).float() * mask).sum()
        return torch.stack([(low_mask.float() * mask).sum(), weight_sum, mask.sum()])

    # ------------------------------------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = self.model.training
        token_group = self.lopti_token_group() if training else None
        first_pass = not training or self.lopti_pass_index() == 0
        loss_inputs = dict(inputs)  # what TRL's loss reads: the AR advantages in place of TRL's
        if AR_ADVANTAGES_KEY in inputs:
            loss_inputs["advantages"] = inputs[AR_ADVANTAGES_KEY]
        call = {"inputs": inputs, "loss_inputs": loss_inputs, "token_group": token_group, "first_pass": first_pass}
        with _temporarily_set(self, "_call_scope", call):
            loss = super().compute_loss(model, loss_inputs, return_outputs, num_items_in_batch)
        if not call.get("applied"):
            raise RuntimeError(
                "GRPOTrainer._compute_loss no longer calls _get_per_token_logps_and_entropies: this TRL version is "
                "not supported by trl_lopti."
            )
        if token_group is not None:
            self._log_pass_loss(token_group, loss.detach())
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        per_token_logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        call = self._call_scope
        if call is None or "token_group" not in call or call.get("applied"):  # only the policy forward of the loss
            return per_token_logps, entropies, aux_loss
        call["applied"] = True
        batch = call["inputs"]
        if LOW_MASK_KEY not in batch:  # an on-policy micro-batch's first forward: pi_old is its detached output
            self._split_at_first_forward(batch, per_token_logps.detach())
            loss_inputs = call["loss_inputs"]  # TRL reads these after this forward
            if "old_per_token_logps" in batch:
                loss_inputs["old_per_token_logps"] = batch["old_per_token_logps"]
            if AR_ADVANTAGES_KEY in batch:
                loss_inputs["advantages"] = batch[AR_ADVANTAGES_KEY]
        if call["token_group"] is not None:
            isolated = self._isolate_active_tokens(call, per_token_logps, entropies, aux_loss)
            per_token_logps, entropies, aux_loss = isolated
        return per_token_logps, entropies, aux_loss

    def _isolate_active_tokens(self, call: dict[str, Any], per_token_logps, entropies, aux_loss):
        """Lopti: gradient only through the log-probabilities and entropies of the pass's active tokens."""
        batch = call["inputs"]
        active_mask = token_group_mask(batch[LOW_MASK_KEY], _loss_mask(batch), call["token_group"])
        per_token_logps = isolate_token_gradients(per_token_logps, active_mask)
        if entropies is not None:
            entropies = isolate_token_gradients(entropies, active_mask)
        if aux_loss is not None and not call["first_pass"]:  # not a per-token term: trained in the first pass only
            aux_loss = aux_loss.detach()
        return per_token_logps, entropies, aux_loss

    def _split_at_first_forward(self, batch: dict[str, Any], forward_logps: torch.Tensor) -> None:
        """Splits a micro-batch whose pi_old was not known at generation; logs the batch once all are split."""
        if self.args.lopti_quantile is not None:
            raise RuntimeError("lopti_quantile without pi_old from generation; please report this bug.")
        old_per_token_logps = batch.get("old_per_token_logps")
        if old_per_token_logps is None:
            old_per_token_logps = forward_logps
            if self.args.lopti_enabled:  # the later pass's ratio is against it (TRL itself reads it from here on)
                batch["old_per_token_logps"] = old_per_token_logps
        threshold = self._generation_batch_threshold(batch)  # the fixed rule: the quantile needs the whole batch
        batch[SPLIT_TOTALS_KEY] = self._split(batch, old_per_token_logps, threshold)
        if not self.model.training:  # an evaluation batch is its own generation batch
            self._log_split_metrics(batch[SPLIT_TOTALS_KEY], threshold)
            return
        micro_batches = self._buffered_inputs or []
        if any(entry is batch for entry in micro_batches) and all(SPLIT_TOTALS_KEY in e for e in micro_batches):
            self._log_split_metrics(sum(entry[SPLIT_TOTALS_KEY] for entry in micro_batches), threshold)

    # ------------------------------------------------------------------------------------------------ metrics
    def _log_split_metrics(self, totals: torch.Tensor, threshold: float) -> None:
        """Logs the split of a whole generation batch (all processes), once: low-token share, AR weight, eta."""
        mode = "train" if self.model.training else "eval"
        totals = self.accelerator.reduce(totals, reduction="sum")
        if totals[2] == 0:  # no completion token anywhere: nothing to report
            return
        self._metrics[mode]["lopti/low_token_share"].append((totals[0] / totals[2]).item())
        if self.args.advantage_reweighting_enabled:
            self._metrics[mode]["lopti/ar_weight_mean"].append((totals[1] / totals[2]).item())
        if self.args.lopti_enabled:
            self._metrics[mode]["lopti/threshold"].append(float(threshold))

    def _log_pass_loss(self, token_group: str, loss: torch.Tensor) -> None:
        # The loss TRL returns is one micro-step's share of its optimizer step; scaled back to a per-step value.
        per_step_loss = loss * self.current_gradient_accumulation_steps
        value = self.accelerator.gather(per_step_loss.reshape(1)).mean().item()
        self._metrics["train"][f"lopti/loss_{token_group}_pass"].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # TRL writes the completions table at every log; a generation batch trained over several optimizer steps
        # (Lopti's passes, steps_per_generation > gradient_accumulation_steps) would be written once per step.
        first_micro_batch = self._buffered_inputs[0] if self.model.training and self._buffered_inputs else {}
        fresh = not first_micro_batch.get(COMPLETIONS_LOGGED_KEY, False)
        with _temporarily_set(self, "log_completions", self.log_completions and fresh):
            if self.log_completions:
                first_micro_batch[COMPLETIONS_LOGGED_KEY] = True
            super().log(logs, start_time)

    # ------------------------------------------------------------------------------------------------ mid-cycle resume
    # BEGIN mid-cycle resume (branch `launchers`, issue 22; to be ported into the core rewrite as it stands).
    # A checkpoint inside a generation batch's schedule (e.g. after the low pass, before the high pass) stores this
    # process's buffered generation batch, and resuming serves it again from the same micro-step. Facts relied on:
    # - TRL 1.16: GRPOTrainer.__init__ sets `self._step = 0` and `self._buffered_inputs = None`; `_prepare_inputs`
    #   regenerates when `self._step % (steps_per_generation * num_iterations) == 0` or `_buffered_inputs is None`.
    # - TRL 1.16: `training_step` adds 1 to `self._step` per micro-step, so at an optimizer step `_step` equals
    #   `global_step * gradient_accumulation_steps` (no partial accumulation: Lopti's passes end on optimizer steps).
    # - TRL 1.16 overrides `_save_checkpoint` and `_load_optimizer_and_scheduler` (entropy controller) and calls super.
    # - transformers 5.24: `_save_checkpoint(model, trial)` runs on every process after the optimizer step and writes
    #   `<output_dir>/checkpoint-<global_step>`; `train` loads `self.state` from the checkpoint (`_init_training_state`)
    #   before `_prepare_for_training`, which loads the weights (DeepSpeed: `deepspeed_load_checkpoint`, with optimizer
    #   and scheduler; FSDP: `_load_from_checkpoint`) and then calls `_load_optimizer_and_scheduler(checkpoint)` on
    #   every backend, before the first micro-step; `_run_epoch` then skips the dataloader batches already trained.
    # - torch 2.13: `torch.load` defaults to `weights_only=True`, enough for the buffered batch (tensors, scalars).
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        cycle_micro_steps = self.args.lopti_num_passes * self.lopti_pass_micro_steps
        if self._buffered_inputs is not None and self._step % cycle_micro_steps != 0:
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            checkpoint = os.path.join(self._get_output_dir(trial=trial), folder)
            os.makedirs(checkpoint, exist_ok=True)
            torch.save(self._buffered_inputs, os.path.join(checkpoint, self._generation_batch_file_name()))

    def _load_optimizer_and_scheduler(self, checkpoint):
        written = len(glob.glob(os.path.join(checkpoint, "lopti_generation_batch_rank*.pt"))) if checkpoint else 0
        if written not in (0, self.accelerator.num_processes):
            raise ValueError(f"{checkpoint} was saved inside a generation batch by {written} processes: resume it with "
                             f"{written} processes, or from a checkpoint between generation batches")  # fmt: skip
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, self._generation_batch_file_name()) if checkpoint is not None else ""
        if os.path.isfile(path):
            device = self.accelerator.device  # torch restores no indexed CPU device ("cpu:0")
            self._buffered_inputs = torch.load(path, map_location="cpu" if device.type == "cpu" else device)
            self._step = self.state.global_step * self.args.gradient_accumulation_steps

    def _generation_batch_file_name(self) -> str:
        return f"lopti_generation_batch_rank{self.accelerator.process_index}.pt"

    # END mid-cycle resume


def describe_method(config: LoptiGRPOConfig) -> str:
    """
    The method a configuration trains with, in words (the model card's "trained with").

    Args:
        config (`LoptiGRPOConfig`):
            The configuration.

    Returns:
        `str`: For example `"GRPO with Advantage Reweighting (alpha=0.3) and Lopti (eta=0.5, low tokens first)"`.
    """
    base = {"grpo": "GRPO", "reinforce_plus_plus": "REINFORCE++"}[config.advantage_estimator]
    parts = []
    if config.advantage_reweighting_enabled:
        parts.append(f"Advantage Reweighting (alpha={config.advantage_reweighting_alpha:g})")
    if config.lopti_enabled:
        order = "low tokens first" if config.lopti_order == "low_first" else "high tokens first, the paper's ablation"
        split = (
            f"eta={config.lopti_threshold:g}" if config.lopti_quantile is None
            else f"eta at the {config.lopti_quantile:g} quantile of each batch"
        )
        parts.append(f"Low-Probability Token Isolation (Lopti, {split}, {order})")
    return f"{base} with {' and '.join(parts)}" if parts else base


def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """The tokens TRL's loss sums over: completion tokens, less tool output where TRL masks it."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


@contextlib.contextmanager
def _temporarily_set(obj: Any, name: str, value: Any):
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)


__all__ = ["LoptiGRPOTrainer", "as_lopti_config", "describe_method"]
