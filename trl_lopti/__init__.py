"""trl_lopti: Advantage Reweighting and Low-Probability Token Isolation (arXiv 2505.12929) for TRL's
`GRPOTrainer` and `RLOOTrainer`.

`import trl_lopti` and its tasks (`trl_lopti.tasks`: puzzles, rewards, graders, data loaders) need no TRL.
The trainers and their configs are imported on first use (`from trl_lopti import LoptiGRPOTrainer`); that
import warns once on a TRL release outside the tested ones, whose trainers then train once `trl-lopti check` has
passed on the machine (`trl_lopti.trl_contract`).
"""

import importlib
from typing import TYPE_CHECKING, Any


__version__ = "0.1.0"

_LAZY_ATTRIBUTES = {
    "LoptiArguments": "trl_lopti.config",
    "LoptiGRPOConfig": "trl_lopti.config",
    "LoptiGRPOTrainer": "trl_lopti.grpo_trainer",
    "LoptiRLOOConfig": "trl_lopti.config",
    "LoptiRLOOTrainer": "trl_lopti.rloo_trainer",
    "TRL_VERSION": "trl_lopti.trl_contract",
}

if TYPE_CHECKING:
    from .config import LoptiArguments, LoptiGRPOConfig, LoptiRLOOConfig
    from .grpo_trainer import LoptiGRPOTrainer
    from .rloo_trainer import LoptiRLOOTrainer
    from .trl_contract import TRL_VERSION


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trl_lopti' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY_ATTRIBUTES])


__all__ = [
    "LoptiArguments",
    "LoptiGRPOConfig",
    "LoptiGRPOTrainer",
    "LoptiRLOOConfig",
    "LoptiRLOOTrainer",
    "__version__",
]
