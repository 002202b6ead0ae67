"""Small helpers over TRL's trainers: TRL's own log-prob forward on a batch, instance attributes set for a
block, and where a trainer class (a user's composition included) gets each method from."""

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

    The forward is the `_get_per_token_logps_and_entropies` that the trainer's loss runs beneath trl_lopti's
    hooks: TRL's (its LM head, temperature and autocast), or a user's override of it. It keeps gradient where grad
    mode is on.

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
    owner = defining_class(type(trainer), "_get_per_token_logps_and_entropies") or GRPOTrainer
    forward = owner._get_per_token_logps_and_entropies
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


def is_trl_lopti_class(klass: type) -> bool:
    """Whether `klass` is one of trl_lopti's own classes."""
    return klass.__module__.split(".")[0] == "trl_lopti"


def defining_class(trainer_class: type, name: str) -> type | None:
    """
    The class whose `name` a trainer of `trainer_class` runs beneath trl_lopti's own hooks: the first class in
    its MRO, trl_lopti's skipped, that defines `name` itself.

    Args:
        trainer_class (`type`):
            A trainer class: TRL's, trl_lopti's, or a user's composition of them.
        name (`str`):
            The method (or attribute).

    Returns:
        `type` or `None`: the class, `None` where no class outside trl_lopti defines `name`.
    """
    for klass in trainer_class.__mro__:
        if name in vars(klass) and not is_trl_lopti_class(klass):
            return klass
    return None


def base_trainer_class(trainer_class: type, trl_trainer_class: type) -> type:
    """The trainer a Lopti trainer class extends: the first class in its MRO that is a subclass of
    `trl_trainer_class` and of no class of trl_lopti (`GRPOTrainer` for `LoptiGRPOTrainer`, `GMPOTrainer` for
    `class LoptiGMPOTrainer(LoptiGRPOTrainer, GMPOTrainer)`)."""
    for klass in trainer_class.__mro__:
        lopti = any(is_trl_lopti_class(ancestor) for ancestor in klass.__mro__)
        if issubclass(klass, trl_trainer_class) and not lopti:
            return klass
    return trl_trainer_class
