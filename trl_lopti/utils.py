"""Small helpers over TRL's trainers: TRL's own log-prob forward on a batch, and instance attributes set for
a block."""

import contextlib
import functools
import inspect
from typing import Any


@functools.cache
def extra_forward_keys() -> tuple[str, ...]:
    """
    The multimodal inputs of TRL's log-prob forward, as TRL names them (its other arguments are ids, masks
    and options).

    TRL 1.14's `GRPOTrainer` takes them as `**kwargs` in `_get_per_token_logps_and_entropies` and passes them
    on to `_full_logits_logps`, which names them.
    """
    from trl import GRPOTrainer

    forward = getattr(GRPOTrainer, "_full_logits_logps", GRPOTrainer._get_per_token_logps_and_entropies)
    parameters = inspect.signature(forward).parameters.items()
    return tuple(name for name, parameter in parameters if parameter.default is None and name != "batch_size")


def trl_completion_logps(trainer, batch: dict[str, Any], model=None, **kwargs: Any) -> tuple:
    """
    Per-token log-probabilities and entropies of the completions of a TRL batch, by TRL's own forward.

    The forward is `_get_per_token_logps_and_entropies` of the trainer's TRL class, whatever a subclass
    overrides: its LM head, temperature and autocast. It keeps gradient where grad mode is on.

    Args:
        trainer (`GRPOTrainer` or `RLOOTrainer`):
            The trainer whose forward runs.
        batch (`dict[str, Any]`):
            A batch as TRL's `_generate_and_score_completions` returns it.
        model (`PreTrainedModel`, *optional*):
            The model to run; defaults to `trainer.model`.
        **kwargs:
            Passed on to the forward (for example `batch_size` or `compute_entropy=True`).

    Returns:
        `tuple`: the log-probabilities (B, T) and the entropies (B, T), `None` unless `compute_entropy=True`.
    """
    import torch
    from trl import GRPOTrainer

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    extra = {key: batch[key] for key in extra_forward_keys() if batch.get(key) is not None}
    if model is None:
        model = trainer.model
    num_tokens = batch["completion_ids"].size(1)
    forward = getattr(trainer, "trl_trainer_class", GRPOTrainer)._get_per_token_logps_and_entropies
    output = forward(trainer, model, input_ids, attention_mask, num_tokens, **extra, **kwargs)
    return output[0], output[1]


@contextlib.contextmanager
def temporarily_set(obj: Any, **values: Any):
    """
    Sets instance attributes of `obj` for the block, then restores what the instance held itself.

    An attribute set here shadows the class's, methods included.

    Args:
        obj (`Any`):
            The instance.
        **values:
            The attributes to set, by name.
    """
    own = {name: vars(obj)[name] for name in values if name in vars(obj)}
    vars(obj).update(values)
    try:
        yield
    finally:
        for name in values:
            del vars(obj)[name]
        vars(obj).update(own)
