"""`trl-lopti check`: verifies trl_lopti's contract with the installed TRL on this machine ([`trl_lopti.check`]), one
line per check and a verdict, cached for the trainers of an untested TRL release; exit code 1 if a check fails."""

import argparse
import time
from collections.abc import Sequence

from ..check import default_device_and_precision, run_checks, write_verdict


def main(argv: Sequence[str]) -> int:
    """Runs every check (or those of `--trainers`), prints each as it ends, then the verdict."""
    parser = argparse.ArgumentParser(prog="trl-lopti check", description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where torch sees it, else cpu")
    parser.add_argument("--precision", choices=("fp64", "fp32", "bf16"), help="default: fp64 on cpu, fp32 on cuda")
    parser.add_argument("--trainers", nargs="+", choices=("grpo", "rloo"), default=["grpo", "rloo"])
    args = parser.parse_args(list(argv))
    from .._compat import stack_versions

    device, precision = default_device_and_precision(args.device, args.precision)
    versions = ", ".join(f"{package} {version}" for package, version in stack_versions().items())
    print(f"trl-lopti check: {versions}; {device}, {precision}", flush=True)
    start = time.perf_counter()
    results = run_checks(
        device, precision, tuple(args.trainers), report=lambda result: print(result.line(), flush=True)
    )
    seconds, failed = time.perf_counter() - start, [result for result in results if not result.passed]
    cached = set(args.trainers) == {"grpo", "rloo"}  # the whole contract: the trainers' gate reads it
    where = f"; verdict cached in {write_verdict(results, device, precision, seconds)}" if cached else ""
    if failed:
        broken = sorted({fact for result in failed for fact in result.broken}) or ["none named"]
        print(
            f"FAILED: {len(failed)} of {len(results)} checks in {seconds:.0f} s, broken facts {', '.join(broken)}{where}"
        )
        return 1
    print(f"passed: {len(results)} of {len(results)} checks in {seconds:.0f} s{where}")
    return 0
