"""Reports of the token diagnostics: Markdown tables, and bar charts by quartile (pandas and matplotlib)."""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .measure import QUARTILE_LABELS


SIGNS = ("positive", "negative")
# Column header -> key of a quartile row.
TABLE_COLUMNS = {
    "quartile": "label",
    "n": "count",
    "mean π_old": "prob_mean",
    "mean |w| (KL)": "abs_w_mean",
    "median |w| (KL)": "abs_w_median",
    "mean |w| (no KL)": "abs_w_no_kl_mean",
    "median |w| (no KL)": "abs_w_no_kl_median",
    "mean ‖dL/dh‖": "hidden_grad_norm_mean",
    "mean ‖dlogπ/dh‖/(1-π)": "ratio_to_one_minus_p_mean",
    "max ratio": "ratio_to_one_minus_p_max",
    "‖Σ grad‖": "summed_grad_norm",
    "cos(full)": "cos_with_full",
    "share of full": "contribution_to_full",
}


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(header: str, rows: Sequence[Sequence[Any]]) -> list[str]:
    """The lines of a Markdown table under the header row `header` (`"a | b | c"`).

    Numbers are written to 4 significant digits, `None` as `-`."""
    separator = "|" + "---|" * len(header.split(" | "))
    return [f"| {header} |", separator, *("| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows)]


def format_tables(report: dict[str, Any]) -> str:
    """The main figures of a `run_token_diagnostics` report (with an `inner_steps` entry, from
    `advance_policy_on_batch`, shown) as Markdown text."""
    gradients = report["gradients"]
    lines = []
    if inner := report.get("inner_steps"):
        steps = f"{inner['steps']} Adam step(s) (lr {_fmt(inner['lr'])}, ‖Δθ‖ {_fmt(inner['update_norm'])})"
        lines += [f"Measured after {steps} of TRL's loss on the batch; π_old = the sampling model.", ""]
    loss = ", ".join(f"{key} {_fmt(value)}" for key, value in gradients["loss"].items() if value is not None)
    quartiles = [[row.get(key) for key in TABLE_COLUMNS.values()] for row in gradients["quartiles"]]
    bound = _fmt(gradients["bound"]["ratio_to_one_minus_p_upper_bound"])
    lines += [
        f"TRL's loss ({loss}); {gradients['num_tokens']} tokens in {gradients['num_completions']} completions; "
        "quartile edges of π_old: " + ", ".join(_fmt(edge) for edge in gradients["quartile_edges"]),
        "",
        *markdown_table(" | ".join(TABLE_COLUMNS), quartiles),
        "",
        f"Bound on ‖dlogπ/dh‖/(1-π): {bound}; KL reference: {_fmt(gradients['kl_reference'])}",
        "Lowest/highest quartile: "
        + ", ".join(f"{key} {_fmt(value)}" for key, value in gradients["lowest_over_highest"].items()),
    ]
    if gradients.get("summed_grad_cosine"):
        cosines = [[f"Q{j + 1}", *row] for j, row in enumerate(gradients["summed_grad_cosine"])]
        table = markdown_table(" | Q1 | Q2 | Q3 | Q4", cosines)
        lines += ["", "Cosine between quartiles' summed gradients:", "", *table]
    probe = report.get("probe")
    if probe and probe.get("methods"):
        title = (
            f"Probability shift after one {probe['optimizer']} update (lr {_fmt(probe['lr'])}, alpha "
            f"{_fmt(probe['alpha'])}, eta {_fmt(probe['eta'])}): share of tokens moved in the direction of "
            "their advantage (mean Δπ)"
        )
        lines += ["", title, ""]
        for sign in SIGNS:
            count = probe["methods"][next(iter(probe["methods"]))]["groups"]["all"][sign]["count"]
            rows = []
            for method, result in probe["methods"].items():
                cells = [result["groups"][group][sign] for group in ("all", "q0", "q1", "q2", "q3")]
                cells = [f"{_fmt(cell['share_in_direction'])} ({_fmt(cell['mean_delta_prob'])})" for cell in cells]
                rows.append([method, *cells, result["update_norm"]])
            header = "method | all | Q1 | Q2 | Q3 | Q4 | ‖Δθ‖"
            lines += [f"{sign} advantages ({count} tokens):", "", *markdown_table(header, rows), ""]
    return "\n".join(lines)


def plot_report(report: dict[str, Any], output_dir: str | os.PathLike) -> list[str]:
    """
    Writes the paper's Figs. 1 and 3 for a `run_token_diagnostics` report: bar charts by pi_old quartile.

    The charts are PNG files in `output_dir`, created if missing.

    Returns:
        `list[str]`:
            The files written: `gradients.png`, and `probability_shift.png` when the report has a probe.
    """
    import pandas as pd

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    gradients = report["gradients"]
    written = []
    rows = gradients["quartiles"]
    labels = [f"{row['label']}\n(n={row['count']})" for row in rows]
    # Title -> {legend entry: key of a quartile row}.
    panels = {
        "mean |w| per token": {"with KL": "abs_w_mean", "without KL": "abs_w_no_kl_mean"},
        "mean ‖dL/dh_t‖ (last hidden state)": {"mean": "hidden_grad_norm_mean"},
        "‖dlogπ_t/dh_t‖ / (1 - π_t)": {"mean": "ratio_to_one_minus_p_mean", "max": "ratio_to_one_minus_p_max"},
    }
    if "summed_grad_norm" in rows[0]:
        panels["‖summed parameter gradient‖"] = {"norm": "summed_grad_norm"}
        panels["cosine with the full gradient"] = {"cosine": "cos_with_full"}
    num_rows = -(-len(panels) // 2)
    figure, axes = new_figure(num_rows, 2, figsize=(12, 4 * num_rows), squeeze=False)
    # An odd count of panels leaves one axis empty.
    for axis, (title, series) in zip(axes.flat, panels.items(), strict=False):
        values = {name: [row.get(key) or 0.0 for row in rows] for name, key in series.items()}
        pd.DataFrame(values, index=labels).plot.bar(ax=axis, title=title, rot=0, fontsize=8)
    # The ratio's panel: its bound is loose (often orders of magnitude above it), hence a log scale.
    axis = axes.flat[2]
    axis.axhline(gradients["bound"]["ratio_to_one_minus_p_upper_bound"], linestyle="--", color="C2", label="bound")
    axis.set_yscale("log")
    axis.legend(fontsize=8)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_axis_off()
    edges = ", ".join(_fmt(edge) for edge in gradients["quartile_edges"])
    title = f"Token diagnostics by π_old quartile (edges {edges})"
    written.append(save_figure(figure, output_dir / "gradients.png", title))
    probe = report.get("probe")
    if probe and probe.get("methods"):
        figure, axes = new_figure(2, 2, figsize=(12, 8))
        titles = {
            "share_in_direction": "share of {} tokens moved their way",
            "mean_delta_prob": "mean Δπ, {} tokens",
        }
        for row, (key, title) in zip(axes, titles.items(), strict=True):
            for axis, sign in zip(row, SIGNS, strict=True):
                values = {
                    method: [result["groups"][f"q{j}"][sign][key] or 0.0 for j in range(4)]
                    for method, result in probe["methods"].items()
                }
                ylim = (0, 1) if key == "share_in_direction" else None
                frame = pd.DataFrame(values, index=QUARTILE_LABELS)
                frame.plot.bar(ax=axis, title=title.format(f"{sign}-advantage"), rot=0, fontsize=8, ylim=ylim)
        title = f"One {probe['optimizer']} update (lr={probe['lr']:g}, α={probe['alpha']:g}, η={_fmt(probe['eta'])})"
        written.append(save_figure(figure, output_dir / "probability_shift.png", title))
    return written


def new_figure(rows: int = 1, columns: int = 1, **kwargs: Any):
    """`matplotlib.pyplot.subplots(rows, columns, **kwargs)` on the file backend Agg (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, columns, **kwargs)


def save_figure(figure, path: str | os.PathLike, title: str | None = None) -> str:
    """Writes `figure` (with the title `title`) to the PNG `path`, closes it and returns the path."""
    import matplotlib.pyplot as plt

    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)
