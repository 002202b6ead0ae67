"""Test-only instrumentation of the launches in tests/test_launchers.py, imported in each training process through the
reward-function path `launcher_probe.fixed_batch_reward` of the test's config (nothing of it is in the package).

What it patches, and why:
- `GRPOTrainer._generate_and_score_completions` (and `RLOOTrainer`'s) serves this process's rows of one fixed generation
  batch (the file `$LAUNCHER_PROBE_BATCH`: prompts, completions, masks, advantages), with pi_old and pi_ref computed as
  TRL computes them (`_get_per_token_logps_and_entropies` of the policy and of TRL's reference model, both as the
  launcher wrapped them; RLOO: pi_old's sum per completion, as RLOO keeps it, and no pi_ref, whose KL penalty is part
  of a reward, which the fixed advantages replace). So 1 and 2 processes train on the same completions; sampling would
  differ with the process count.
- `shuffle_sequence_dict` of TRL's GRPO and RLOO modules keeps the rows in order, and the rows of each optimizer step
  are split over the processes in order (`local_rows`), so that every optimizer step of the 2-process run trains the
  same rows, in the same micro-batch pairs, as the 1-process run.
- Qwen2's RMSNorm in the model's dtype and TRL's log-prob head in the model's dtype (`testing_utils`): a float64 model then
  gives the same result on 1 and 2 processes to ~1e-15 instead of ~1e-7 (float32 round trips).
- `LoptiGRPOTrainer.train` (and `LoptiRLOOTrainer`'s) writes, per process, what the launcher really built
  (`$LAUNCHER_PROBE_OUT`): the trainer class, the distributed type, the types, dtypes and local sizes of parameters and
  optimizer tensors, the number of generation batches served, and the micro-step counter at the start.
"""

import json
import os
from pathlib import Path

import torch
import trl.trainer.grpo_trainer as grpo_module
import trl.trainer.rloo_trainer as rloo_module
from testing_utils import patch_float64_norms, use_exact_log_prob_head
from trl import GRPOTrainer, RLOOTrainer

from trl_lopti import LoptiGRPOTrainer, LoptiRLOOTrainer


def fixed_batch_reward(completions, **kwargs):
    """Never called: the fixed batch carries its advantages."""
    raise AssertionError("launcher_probe: the fixed generation batch was not served")


def local_rows(rows: int, rows_per_step: int, rank: int, world_size: int) -> torch.Tensor:
    """The global rows one process trains: its contiguous share of the rows of every optimizer step, in order."""
    share = rows_per_step // world_size
    return torch.cat(
        [torch.arange(step + rank * share, step + (rank + 1) * share) for step in range(0, rows, rows_per_step)]
    )


def serve_fixed_batch(self, inputs):
    self._probe_generations = getattr(self, "_probe_generations", 0) + 1
    batch = torch.load(os.environ["LAUNCHER_PROBE_BATCH"])
    args, world = self.args, self.accelerator.num_processes
    rows = local_rows(
        len(batch["advantages"]),
        args.per_device_train_batch_size * args.gradient_accumulation_steps * world,
        self.accelerator.process_index,
        world,
    )
    local = {key: value[rows] if value.dim() else value for key, value in batch.items()}
    local = {key: value.to(self.accelerator.device) for key, value in local.items()}
    input_ids = torch.cat([local["prompt_ids"], local["completion_ids"]], dim=1)
    attention_mask = torch.cat([local["prompt_mask"], local["completion_mask"]], dim=1)
    length = local["completion_ids"].size(1)
    with torch.no_grad():
        old_per_token_logps = self._get_per_token_logps_and_entropies(self.model, input_ids, attention_mask, length)[0]
        if isinstance(
            self, RLOOTrainer
        ):  # RLOO keeps each completion's sum (the trainer checks it against its forward)
            return {**local, "old_logps": (old_per_token_logps * local["completion_mask"]).sum(1)}
        local["old_per_token_logps"] = old_per_token_logps
        if self.beta != 0.0:
            local["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                self.ref_model, input_ids, attention_mask, length
            )[0]
    return local


def local_numel(tensor) -> int:
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor.numel()
    return tensor.to_local().numel() if hasattr(tensor, "to_local") else tensor.numel()


def zero_stage(trainer):
    engine = trainer.model_wrapped
    return engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None


def offload_policy(model):
    """The offload policies FSDP2 shards the model's modules with (None without FSDP2)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    groups = [fully_shard.state(m)._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    policies = {repr(group.offload_policy) for group in groups if group is not None}
    return sorted(policies) or None


def record(trainer, step_at_start: int) -> None:
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    # the optimized tensors: its parameter groups' (ZeRO-3 empties them between steps) and those it holds state for
    optimized = [*(t for group in optimizer.param_groups for t in group["params"]), *optimizer.state]
    optimized = list({id(t): t for t in optimized}.values())
    states = [value for tensor in optimized for value in optimizer.state.get(tensor, {}).values() if value.dim()]
    parameters = list(trainer.model.parameters())
    facts = {
        "trainer_class": type(trainer).__name__,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "parameter_classes": sorted({type(p).__name__ for p in parameters}),
        "zero3_partitioned": all(hasattr(p, "ds_tensor") and p.numel() == 0 for p in parameters),
        "parameter_dtypes": sorted({str((p.ds_tensor if hasattr(p, "ds_tensor") else p).dtype) for p in parameters}),
        "parameter_elements_local": sum(local_numel(p) for p in parameters),
        "parameter_elements": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in parameters),
        "optimizer_elements_local": sum(local_numel(t) for t in optimized),
        "optimizer_dtypes": sorted({str(t.dtype) for t in optimized}),
        "optimizer_state_elements_local": sum(local_numel(s) for s in states),
        "optimizer_state_dtypes": sorted({str(s.dtype) for s in states}),
        "wrapped_class": type(trainer.model_wrapped).__name__,
        "zero_stage": zero_stage(trainer),
        "offload_policy": offload_policy(trainer.model),
        "generations": getattr(trainer, "_probe_generations", 0),
        "step_at_start": step_at_start,
        "micro_steps_per_optimizer_step": trainer.args.gradient_accumulation_steps,
        "global_step": trainer.state.global_step,
    }
    name = f"{Path(trainer.args.output_dir).name}_rank{trainer.accelerator.process_index}.json"
    Path(os.environ["LAUNCHER_PROBE_OUT"], name).write_text(json.dumps(facts))


def train_and_record(self, *args, **kwargs):
    step = {}
    load = self._load_optimizer_and_scheduler

    def load_and_note(checkpoint):
        load(checkpoint)
        step["at_start"] = self._step

    self._load_optimizer_and_scheduler = load_and_note
    use_exact_log_prob_head(self)  # on the model objects the launcher then wraps in place (or around)
    output = self._probe_train(*args, **kwargs)
    record(self, step.get("at_start", 0))
    return output


patch_float64_norms()
for trl_trainer, module, lopti_trainer in (
    (GRPOTrainer, grpo_module, LoptiGRPOTrainer),
    (RLOOTrainer, rloo_module, LoptiRLOOTrainer),
):
    trl_trainer._generate_and_score_completions = serve_fixed_batch
    module.shuffle_sequence_dict = lambda batch: batch
    lopti_trainer._probe_train = lopti_trainer.train
    lopti_trainer.train = train_and_record
