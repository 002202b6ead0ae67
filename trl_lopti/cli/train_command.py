"""`trl-lopti grpo` and `trl-lopti rloo` (and `trl-lopti train`, the former name of `grpo`): a rehearsal
(`--rehearse`, [`rehearse`]), else a dry run (`--dry_run`) or a training run ([`train`])."""

import json
import os
import sys
from collections.abc import Sequence
from functools import partial

from . import rehearse
from .base import CliError
from .train import checked_args, run_training


USAGE = """needs a preset (trl-lopti presets), a YAML file or flags (trl-lopti {0} --help), e.g.
  trl-lopti {0} --config kk/qwen2.5-3b-instruct{1}_ar_lopti --dry_run     # checked and printed; no model loaded
  trl-lopti {0} --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --task knights_knaves --output_dir out
  trl-lopti {0} --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name prompts.jsonl \
      --reward_funcs my_rewards.exact_answer --output_dir out           # your data and reward (docs/cli.md)"""


def main(argv: Sequence[str], trainer: str) -> int:
    """`trl-lopti grpo` or `rloo`: parse, check, then print the resolved configuration (`--dry_run`), rehearse
    (`--rehearse`) or train.

    Args:
        argv (`Sequence[str]`): the arguments after the command.
        trainer (`str`): `grpo` or `rloo`.
    """
    if not argv:
        raise CliError(USAGE.format(trainer, "_rloo" if trainer == "rloo" else ""))
    # Before parsing: the rehearsal sets up the launcher's backend first.
    if any(arg.startswith("--rehearse") for arg in argv):
        return rehearse.main(list(argv), trainer)
    script_args, training_args, model_args, resolved = checked_args(argv, trainer)
    if not script_args.dry_run:
        run_training(script_args, training_args, model_args)
    elif os.environ.get("RANK", "0") == "0":
        # Printed once under a launcher.
        print(json.dumps(resolved, indent=2, default=str))
    return 0


grpo = partial(main, trainer="grpo")
"""`trl-lopti grpo`: [`main`] with `LoptiGRPOTrainer`."""

rloo = partial(main, trainer="rloo")
"""`trl-lopti rloo`: [`main`] with `LoptiRLOOTrainer`."""


def train(argv: Sequence[str]) -> int:
    """`trl-lopti train`: `trl-lopti grpo` under its former name, which says so.

    Args:
        argv (`Sequence[str]`): the arguments after the command.
    """
    print("trl-lopti train: now `trl-lopti grpo` (`trl-lopti rloo` for RLOO), which runs", file=sys.stderr)
    return grpo(argv)
