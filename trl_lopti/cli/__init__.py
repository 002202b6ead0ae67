"""The `trl-lopti` command line: `main` (`main.py`), its table of commands (`base.py`), one module per command."""

from .base import CliError
from .main import main
