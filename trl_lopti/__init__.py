"""trl_lopti: Advantage Reweighting and Low-Probability Token Isolation (arXiv 2505.12929) for TRL."""

from ._compat import check_trl_version


__version__ = "0.1.0"
TRL_VERSION = check_trl_version()

from .config import LoptiGRPOConfig  # noqa: E402
from .trainer import LoptiGRPOTrainer  # noqa: E402


__all__ = ["LoptiGRPOConfig", "LoptiGRPOTrainer", "__version__"]
