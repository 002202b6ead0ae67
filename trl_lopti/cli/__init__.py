"""The `trl-lopti` command line: `main` and its table of commands (in `main.py`), and one module per command."""

from .main import CliError, main
