"""The `trl-lopti` command line: `main` (in `main.py`) and one module per command (`train`, `demo`, `diagnose`)."""

from .main import main
from .parsing import CliError
