"""The `trl-lopti` command line (`main`), and the `train` command's parsing and data building for scripts and tests."""

from .errors import CliError
from .main import main
from .train import LoptiScriptArguments, make_parser, parse_train_args, resolved_config, run_training
from .train_inputs import build_datasets, dataset_spec, resolve_model, resolve_reward_funcs


__all__ = [
    "CliError",
    "LoptiScriptArguments",
    "build_datasets",
    "dataset_spec",
    "main",
    "make_parser",
    "parse_train_args",
    "resolve_model",
    "resolve_reward_funcs",
    "resolved_config",
    "run_training",
]
