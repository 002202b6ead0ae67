"""Reports of the token diagnostics: Markdown tables and bar charts by probability quartile (through `plots`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .measure import QUARTILE_LABELS
from .plots import Panel, plot_panels


SIGNS = ("positive", "negative")
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


def format_tables(report: dict[str, Any]) -> str:
    """
    Renders the main figures of a `run_token_diagnostics` report as Markdown tables.

    Args:
        report (`dict[str, Any]`):
            Output of `run_token_diagnostics` (an `inner_steps` entry, from `advance_policy_on_batch`, is shown).

    Returns:
        `str`: Markdown text.
    """
    gradients, lines = report["gradients"], []
    if report.get("inner_steps"):
        inner = report["inner_steps"]
        lines += [
            f"Measured after {inner['steps']} Adam step(s) (lr {_fmt(inner['lr'])}, ‖Δθ‖ "
            f"{_fmt(inner['update_norm'])}) of TRL's loss on the batch; π_old = the sampling model.",
            "",
        ]
    loss = ", ".join(f"{key} {_fmt(value)}" for key, value in gradients["loss"].items() if value is not None)
    lines += [
        f"TRL's loss ({loss}); {gradients['num_tokens']} tokens in {gradients['num_completions']} completions; "
        "quartile edges of π_old: " + ", ".join(_fmt(edge) for edge in gradients["quartile_edges"]),
        "",
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "---|" * len(TABLE_COLUMNS),
    ]
    for row in gradients["quartiles"]:
        lines.append("| " + " | ".join(_fmt(row.get(key)) for key in TABLE_COLUMNS.values()) + " |")
    lines += [
        "",
        f"Bound on ‖dlogπ/dh‖/(1-π): {_fmt(gradients['bound']['ratio_to_one_minus_p_upper_bound'])}; "
        f"KL reference: {_fmt(gradients['kl_reference'])}",
        "Lowest/highest quartile: "
        + ", ".join(f"{key} {_fmt(value)}" for key, value in gradients["lowest_over_highest"].items()),
    ]
    if gradients.get("summed_grad_cosine"):
        lines += ["", "Cosine between quartiles' summed gradients:", "", "| | Q1 | Q2 | Q3 | Q4 |", "|---" * 5 + "|"]
        lines += [
            f"| Q{j + 1} | " + " | ".join(_fmt(value) for value in row) + " |"
            for j, row in enumerate(gradients["summed_grad_cosine"])
        ]
    probe = report.get("probe")
    if probe and probe.get("methods"):
        lines += [
            "",
            f"Probability shift after one {probe['optimizer']} update (lr {_fmt(probe['lr'])}, alpha "
            f"{_fmt(probe['alpha'])}, eta {_fmt(probe['eta'])}): share of tokens moved in the direction of their "
            "advantage (mean Δπ)",
            "",
        ]
        for sign in SIGNS:
            count = probe["methods"][next(iter(probe["methods"]))]["groups"]["all"][sign]["count"]
            lines += [
                f"{sign} advantages ({count} tokens):",
                "",
                "| method | all | Q1 | Q2 | Q3 | Q4 | ‖Δθ‖ |",
                "|---|---|---|---|---|---|---|",
            ]
            for method, result in probe["methods"].items():
                cells = [result["groups"][group][sign] for group in ("all", "q0", "q1", "q2", "q3")]
                cells = [f"{_fmt(cell['share_in_direction'])} ({_fmt(cell['mean_delta_prob'])})" for cell in cells]
                lines.append(f"| {method} | " + " | ".join(cells) + f" | {_fmt(result['update_norm'])} |")
            lines.append("")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], output_dir: str | os.PathLike) -> list[str]:
    """
    Writes bar charts by probability quartile (the paper's Fig. 1 and Fig. 3) of a `run_token_diagnostics` report.

    Args:
        report (`dict[str, Any]`):
            Output of `run_token_diagnostics`.
        output_dir (`str` or `os.PathLike`):
            Folder for the PNG files (created if missing).

    Returns:
        `list[str]`: The files written: `gradients.png`, and `probability_shift.png` when the report has a probe.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    gradients = report["gradients"]
    rows = gradients["quartiles"]
    positions = list(range(len(rows)))
    labels = [f"{row['label']}\n(n={row['count']})" for row in rows]

    def bars(title: str, **series: str) -> Panel:
        values = {name: (positions, [row.get(key) or 0.0 for row in rows]) for name, key in series.items()}
        return Panel(title, values, kind="bar", xticklabels=labels)

    ratio = bars("‖dlogπ_t/dh_t‖ / (1 - π_t)", mean="ratio_to_one_minus_p_mean", max="ratio_to_one_minus_p_max")
    ratio.hlines = {"bound √2·σmax(W)/T": gradients["bound"]["ratio_to_one_minus_p_upper_bound"]}
    ratio.yscale = "log"  # the bound is loose: often orders of magnitude above the measured ratio
    panels = [
        bars("mean |w| per token", **{"with KL": "abs_w_mean", "without KL": "abs_w_no_kl_mean"}),
        bars("mean ‖dL/dh_t‖ (last hidden state)", mean="hidden_grad_norm_mean"),
        ratio,
    ]
    if "summed_grad_norm" in rows[0]:
        panels += [
            bars("‖summed parameter gradient‖", norm="summed_grad_norm"),
            bars("cosine with the full gradient", cosine="cos_with_full"),
        ]
    edges = ", ".join(_fmt(edge) for edge in gradients["quartile_edges"])
    title = f"Token diagnostics by π_old quartile (edges {edges})"
    written = [plot_panels(output_dir / "gradients.png", panels, title)]
    probe = report.get("probe")
    if probe and probe.get("methods"):
        panels = []
        titles = {"share_in_direction": "share of {} tokens moved their way", "mean_delta_prob": "mean Δπ, {} tokens"}
        for key, title in titles.items():
            for sign in SIGNS:
                series = {
                    method: (positions, [result["groups"][f"q{j}"][sign][key] or 0.0 for j in positions])
                    for method, result in probe["methods"].items()
                }
                panels.append(
                    Panel(
                        title.format(f"{sign}-advantage"),
                        series,
                        kind="bar",
                        xticklabels=QUARTILE_LABELS,
                        ylim=(0, 1) if key == "share_in_direction" else None,
                    )
                )
        title = f"One {probe['optimizer']} update (lr={probe['lr']:g}, α={probe['alpha']:g}, η={_fmt(probe['eta'])})"
        written.append(plot_panels(output_dir / "probability_shift.png", panels, title))
    return written
