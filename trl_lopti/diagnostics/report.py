"""Reports of the token diagnostics: Markdown tables and bar charts by probability quartile."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .measure import QUARTILE_LABELS


_PROBE_SIGNS = ("positive", "negative")


def plot_report(report: dict[str, Any], output_dir: str | os.PathLike) -> list[str]:
    """
    Writes bar charts by probability quartile (as in the paper's Fig. 1 and Fig. 3) for a `run_token_diagnostics`
    report.

    Args:
        report (`dict[str, Any]`):
            Output of `run_token_diagnostics`.
        output_dir (`str` or `os.PathLike`):
            Folder for the PNG files.

    Returns:
        `list[str]`: Paths of the files written: `gradients.png`, and `probability_shift.png` when the report has a
        probe.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    gradients = report["gradients"]
    rows = gradients["quartiles"]
    labels = [f"{row['label']}\n(n={row['count']})" for row in rows]
    positions = list(range(len(rows)))

    def values(key: str) -> list[float]:
        return [row.get(key) if row.get(key) is not None else 0.0 for row in rows]

    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.4
    axes[0, 0].bar([p - width / 2 for p in positions], values("abs_w_mean"), width, label="with KL")
    axes[0, 0].bar([p + width / 2 for p in positions], values("abs_w_no_kl_mean"), width, label="without KL")
    axes[0, 0].set_title("mean |w| per token")
    axes[0, 0].legend()
    axes[0, 1].bar(positions, values("hidden_grad_norm_mean"))
    axes[0, 1].set_title("mean per-token ||dL_t/dh_t|| (last hidden state)")
    axes[1, 0].bar(positions, values("ratio_to_one_minus_p_mean"), label="mean")
    axes[1, 0].plot(positions, values("ratio_to_one_minus_p_max"), "k^", label="max")
    bound = gradients["bound"]["ratio_to_one_minus_p_upper_bound"]
    if bound is not None:
        axes[1, 0].axhline(bound, color="r", linestyle="--", label="bound sqrt(2)·σmax(W)/T")
    axes[1, 0].set_title("||dlogπ_t/dh_t|| / (1 - π_t)")
    axes[1, 0].set_yscale("log")  # the bound is loose: it is often orders of magnitude above the measured ratio
    axes[1, 0].legend(fontsize=8)
    if rows and "summed_grad_norm" in rows[0]:
        axes[1, 1].bar(positions, values("summed_grad_norm"), 0.6, label="||Σ grad||")
        twin = axes[1, 1].twinx()
        twin.plot(positions, values("cos_with_full"), "ko-", label="cos with full")
        twin.set_ylim(-1, 1)
        twin.set_ylabel("cosine with full gradient")
        axes[1, 1].set_title("summed parameter gradient per quartile")
        axes[1, 1].legend(loc="lower left", fontsize=8)
        twin.legend(loc="lower right", fontsize=8)
    else:
        axes[1, 1].set_axis_off()
    edges = ", ".join(f"{edge:.3g}" for edge in gradients["quartile_edges"] if edge is not None)
    for axis in axes.flat:
        if axis.axison:
            axis.set_xticks(positions)
            axis.set_xticklabels(labels, fontsize=8)
    figure.suptitle(f"Token diagnostics by π_old quartile (edges {edges})")
    figure.subplots_adjust(left=0.06, right=0.94, bottom=0.08, top=0.9, hspace=0.4, wspace=0.3)
    path = output_dir / "gradients.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    written.append(str(path))

    probe = report.get("probe")
    if probe and probe.get("methods"):
        methods = list(probe["methods"])
        figure, axes = plt.subplots(2, 2, figsize=(13, 8))
        width = 0.8 / len(methods)
        for col, sign in enumerate(_PROBE_SIGNS):
            for index, method in enumerate(methods):
                groups = probe["methods"][method]["groups"]
                shares = [groups[f"q{j}"][sign]["share_in_direction"] for j in range(4)]
                deltas = [groups[f"q{j}"][sign]["mean_delta_prob"] for j in range(4)]
                offsets = [p - 0.4 + width * (index + 0.5) for p in positions]
                axes[0, col].bar(offsets, [s if s is not None else 0.0 for s in shares], width, label=method)
                axes[1, col].bar(offsets, [d if d is not None else 0.0 for d in deltas], width, label=method)
            axes[0, col].set_title(f"share of {sign}-advantage tokens moved in their direction")
            axes[0, col].set_ylim(0, 1)
            axes[1, col].set_title(f"mean Δπ of {sign}-advantage tokens")
            for row in range(2):
                axes[row, col].set_xticks(positions)
                axes[row, col].set_xticklabels(QUARTILE_LABELS, fontsize=8)
        axes[0, 0].legend(fontsize=8)
        figure.suptitle(
            f"One {probe['optimizer']} step (lr={probe['lr']:g}, α={probe['alpha']:g}, η={probe['eta']:g})"
        )
        figure.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.9, hspace=0.35, wspace=0.2)
        path = output_dir / "probability_shift.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(str(path))
    return written


def format_tables(report: dict[str, Any]) -> str:
    """
    Renders the main numbers of a `run_token_diagnostics` report as Markdown tables.

    Args:
        report (`dict[str, Any]`):
            Output of `run_token_diagnostics`.

    Returns:
        `str`: Markdown text.
    """

    def fmt(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    gradients = report["gradients"]
    lines = []
    if report.get("inner_steps"):
        inner = report["inner_steps"]
        lines += [f"Measured after {inner['steps']} Adam step(s) (lr {fmt(inner['lr'])}, ‖Δθ‖ "
                  f"{fmt(inner['update_norm'])}) of GRPO on the batch; reference and π_old = the sampling model.", ""]
    lines += [
        f"Tokens: {gradients['num_tokens']} in {gradients['num_completions']} completions; quartile edges of π_old: "
        + ", ".join(fmt(edge) for edge in gradients["quartile_edges"]),
        "",
        "| quartile | n | mean π | mean |w| (KL) | median |w| (KL) | mean |w| (no KL) | median |w| (no KL) "
        "| mean ‖dL_t/dh‖ | mean ‖dlogπ/dh‖/(1-π) | max ratio | ‖Σ grad‖ | cos(full) | share of full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in gradients["quartiles"]:
        lines.append("| " + " | ".join(fmt(row.get(key)) for key in (
            "label", "count", "prob_mean", "abs_w_mean", "abs_w_median", "abs_w_no_kl_mean", "abs_w_no_kl_median",
            "hidden_grad_norm_mean", "ratio_to_one_minus_p_mean", "ratio_to_one_minus_p_max", "summed_grad_norm",
            "cos_with_full", "contribution_to_full")) + " |")
    lines.append("")
    lines.append(f"Bound on ‖dlogπ/dh‖/(1-π): {fmt(gradients['bound']['ratio_to_one_minus_p_upper_bound'])}; "
                 f"KL reference: {gradients['kl_reference']}")
    lines.append("Lowest/highest quartile: " + ", ".join(
        f"{key} {fmt(value)}" for key, value in gradients["lowest_over_highest"].items()))
    if gradients.get("summed_grad_cosine"):
        lines += ["", "Cosine between quartiles' summed gradients:", "", "| | Q1 | Q2 | Q3 | Q4 |",
                  "|---|---|---|---|---|"]
        for j, row in enumerate(gradients["summed_grad_cosine"]):
            lines.append(f"| Q{j + 1} | " + " | ".join(fmt(value) for value in row) + " |")
    probe = report.get("probe")
    if probe and probe.get("methods"):
        lines += ["", f"Probability shift after one {probe['optimizer']} step (lr {fmt(probe['lr'])}, alpha "
                      f"{fmt(probe['alpha'])}, eta {fmt(probe['eta'])}): share moved in the direction of the "
                      "advantage (mean Δπ)", ""]
        for sign in _PROBE_SIGNS:
            lines += [f"{sign} advantages ({probe['token_counts'][sign]} tokens):", "",
                      "| method | all | Q1 | Q2 | Q3 | Q4 | ‖Δθ‖ |", "|---|---|---|---|---|---|---|"]
            for method, result in probe["methods"].items():
                cells = []
                for group in ("all", "q0", "q1", "q2", "q3"):
                    entry = result["groups"][group][sign]
                    cells.append(f"{fmt(entry['share_in_direction'])} ({fmt(entry['mean_delta_prob'])})")
                lines.append(f"| {method} | " + " | ".join(cells) + f" | {fmt(result['update_norm'])} |")
            lines.append("")
    return "\n".join(lines)
