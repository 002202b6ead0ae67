"""`.ci/run`, after `make demo`: what the demo printed against the README, and whether training changed the model.

    python .ci/check_demo.py LOG RESULTS_JSON

- the README's demo output (the fenced block between its `demo` snippet markers) appears in LOG, line for line: the
  table and the figures the README shows are the ones this run printed;
- RESULTS_JSON (the demo's `results.json`) says that training changed the model: at least one weight tensor changed
  and the relative change of all of them is above 0.

Prints what it checked; exits 1 with the differences otherwise. Standard library only.
"""

import difflib
import json
import re
import sys
from pathlib import Path


README = Path(__file__).resolve().parents[1] / "README.md"
MARKERS = ("<!-- --8<-- [start:demo] -->", "<!-- --8<-- [end:demo] -->")


def readme_output(readme: str) -> str:
    """The demo output the README shows: the fenced block between its `demo` snippet markers."""
    section = readme.split(MARKERS[0], 1)[-1].split(MARKERS[1], 1)[0]
    match = re.search(r"^```\w*\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    if MARKERS[0] not in readme or match is None:
        raise ValueError(f"README.md has no fenced block between {MARKERS[0]} and {MARKERS[1]}")
    return match.group(1)


def problems(readme: str, printed: str, results: dict) -> list[str]:
    """What differs between the README's demo output and a run's (`printed`, `results`); empty when nothing does."""
    found = []
    expected = readme_output(readme)
    if expected not in printed:
        lines = printed.splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if line.startswith("held-out prompts")), len(lines))
        got = lines[start : start + len(expected.splitlines())]
        diff = difflib.unified_diff(expected.splitlines(keepends=True), got, "README.md", "make demo printed")
        found.append("the README's demo output is not what `make demo` printed:\n" + "".join(diff))
    moved = results.get("weight_change", {})
    if not (moved.get("changed_tensors", 0) > 0 and moved.get("relative_change", 0) > 0):
        found.append(f"training did not change the model: weight_change {moved}")
    return found


def main(log: str, results_json: str) -> int:
    results = json.loads(Path(results_json).read_text())
    found = problems(README.read_text(), Path(log).read_text(), results)
    for problem in found:
        print(f"check_demo: {problem}")
    if not found:
        moved = results["weight_change"]
        print(
            f"check_demo: the README's demo output is what `make demo` printed, and training changed "
            f"{moved['changed_tensors']} of {moved['tensors']} weight tensors (relative change "
            f"{moved['relative_change']:.3e}; wall time {results['timings_s']['total'] / 60:.1f} min)"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
