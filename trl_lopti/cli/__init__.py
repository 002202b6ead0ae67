"""The `trl-lopti` command line: `main` (in `main.py`) and one module per command (`train`, `demo`, `diagnose`)."""

from .errors import CliError
from .main import main
