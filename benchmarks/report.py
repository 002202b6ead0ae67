"""The benchmarks' one statistics helper and one report writer: medians per batch, Student-t intervals (scipy),
Markdown (`trl_lopti.diagnostics.report.markdown_table`) and plots (pandas and matplotlib)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trl_lopti.diagnostics.report import markdown_table, new_figure, save_figure


BASELINE = "grpo"
"""The configuration every ratio and paired difference is taken against."""

SIGNS = ("positive", "negative")


# ---------------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------------
def t_interval(values: Sequence[float | None], confidence: float = 0.95) -> dict[str, Any]:
    """
    Mean and two-sided Student-t confidence interval of the mean (`scipy.stats.t.interval`).

    Args:
        values (`Sequence[float]`):
            One value per seed; `None` and NaN are dropped.
        confidence (`float`, *optional*, defaults to `0.95`):
            Confidence level.

    Returns:
        `dict`: `mean`, `low`, `high`, `sd`, `n` (`low`, `high` and `sd` are `None` below 2 values).
    """
    from scipy import stats

    values = [float(v) for v in values if v is not None and not math.isnan(v)]
    n = len(values)
    mean = sum(values) / n if n else None
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "sd": None, "n": n}
    low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=stats.sem(values))
    return {"mean": mean, "low": float(low), "high": float(high), "sd": statistics.stdev(values), "n": n}


def paired_difference(values: dict[int, float | None], baseline: dict[int, float | None]) -> dict[str, Any]:
    """[`t_interval`] of `values[seed] - baseline[seed]` over the seeds where both are known (paired by seed)."""
    return t_interval(
        [
            values[s] - baseline[s]
            for s in values
            if s in baseline and values[s] is not None and baseline[s] is not None
        ]
    )


def batch_medians(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """
    Medians over the measured (non-warm-up) generation batches of a run.

    Returns:
        `dict`: `measured_batches`; `wall` and `cpu`: the median of every phase and `completion_tokens_per_s`;
        `counts`: the median of every count (equal across batches unless a pass was skipped).
    """
    measured = [batch for batch in batches if not batch["warmup"]]
    medians: dict[str, Any] = {"measured_batches": len(measured)}
    tokens = statistics.median(batch["completion_tokens"] for batch in measured)
    for clock in ("wall", "cpu"):
        medians[clock] = {phase: statistics.median(b[clock][phase] for b in measured) for phase in measured[0][clock]}
        medians[clock]["completion_tokens_per_s"] = tokens / medians[clock]["step_s"]
    counts = [key for key, value in measured[0].items() if isinstance(value, int) and not isinstance(value, bool)]
    medians["counts"] = {key: statistics.median(batch[key] for batch in measured) for key in counts}
    return medians


def fig3_shares(fig3_batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pools the Fig.-3 statistic (`trl_lopti.diagnostics.probability_shift`) over batches; per sign: `count`,
    `in_direction`, `share` per quartile, and `all` (share)."""
    pooled = {}
    for sign in SIGNS:
        count = [sum(batch[f"q{q}"][sign]["count"] for batch in fig3_batches) for q in range(4)]
        hits = [sum(batch[f"q{q}"][sign]["in_direction"] for batch in fig3_batches) for q in range(4)]
        pooled[sign] = {
            "count": count,
            "in_direction": hits,
            "share": [h / c if c else None for h, c in zip(hits, count, strict=True)],
            "all": sum(hits) / sum(count) if sum(count) else None,
        }
    return pooled


# ---------------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------------
def interval(stat: dict[str, Any] | None, digits: int = 3) -> str:
    """`mean [low, high]`, or the mean alone, or `n/a`."""
    if not stat or stat.get("mean") is None:
        return "n/a"
    if stat.get("low") is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} [{stat['low']:.{digits}f}, {stat['high']:.{digits}f}]"


def cost_markdown(report: dict[str, Any]) -> str:
    """
    The tables of a cost experiment: medians per generation batch on each clock (wall; on CPU also process CPU time),
    ratios to `grpo` in parentheses, the counted passes and peak memory; then the conditions of the run.
    """
    runs, size, env = report["runs"], report["size"], report["environment"]
    on_gpu = size["device"] == "cuda"
    base = next((run for run in runs if run["name"] == BASELINE), None)

    def with_ratio(value: float, reference: float | None, digits: int) -> str:
        text = f"{value:.{digits}f}"
        return f"{text} ({value / reference:.2f}x)" if reference else text

    memory = "peak CUDA mem (MB)" if on_gpu else "peak RSS (MB)"
    header = (
        "configuration | step (s) | generation (s) | scoring (s) | loss+bwd+opt (s) | fwd grad / no-grad | bwd | "
        f"opt steps | {memory} | compl. tok/s"
    )
    timed = [("step_s", 2), ("generation_s", 2), ("scoring_s", 3), ("loss_backward_optimizer_s", 2)]
    lines = []
    for clock, title in [("wall", "Wall-clock time"), ("cpu", "Process CPU time (all threads)")][: 1 if on_gpu else 2]:
        rows = []
        for run in runs:
            medians, counts = run["medians"][clock], run["medians"]["counts"]
            reference = base["medians"][clock] if base and run is not base else {}
            rows.append(
                [
                    f"{run['name']}: {run['description']}",
                    *(with_ratio(medians[key], reference.get(key), digits) for key, digits in timed),
                    f"{counts['policy_forwards_grad']:g} / {counts['policy_forwards_no_grad']:g}",
                    f"{counts['backward_passes']:g}",
                    f"{counts['optimizer_steps']:g}",
                    with_ratio(run["peak_memory_mb"], base["peak_memory_mb"] if reference else None, 0),
                    with_ratio(medians["completion_tokens_per_s"], reference.get("completion_tokens_per_s"), 1),
                ]
            )
        lines += [f"{title} per generation batch (median):", "", *markdown_table(header, rows), ""]
    shares = [
        share
        for run in runs
        if run["lopti"] and run["lopti"].get("lopti_threshold") is not None
        for batch in run["batches"]
        for share in batch["logged"].get("lopti/low_token_share", [])
    ]  # fixed eta
    low_token_share = f", low-token share {statistics.median(shares):.2f} (median over batches)" if shares else ""
    conditions = (
        f"Size `{size['name']}`: model `{report['model']}`, {size['prompts_per_batch']} prompts x "
        f"{size['num_generations']} completions of {size['max_completion_length']} tokens per generation batch, "
        f"micro-batch {size['per_device_train_batch_size']} x {size['gradient_accumulation_steps']} accumulation "
        f"steps (on-policy), {env['device']}, {'bf16 autocast' if size['bf16'] else 'float32'}, gradient checkpointing "
        f"{'on' if size['gradient_checkpointing'] else 'off'}, torch threads {env['torch_threads']}. "
        f"Medians over {runs[0]['medians']['measured_batches'] if runs else 0} generation batches after "
        f"{size['warmup_batches']} warm-up batch(es) per configuration. "
        f"Lopti threshold {report['lopti_threshold']:.4g}{low_token_share}. "
        f"1-minute load average {report['load_average_at_start'][0]:.1f} at the start and "
        f"{report['load_average_at_end'][0]:.1f} at the end on {env['cpu_count']} CPUs."
    )
    if report.get("skipped"):
        conditions += " Skipped: " + ", ".join(report["skipped"]) + "."
    return "\n".join([*lines, conditions]) + "\n"


def compare_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """
    Per method: every figure's mean and t interval over seeds, the pooled Fig.-3 shares, and under `paired` the
    difference of every per-seed figure to `grpo`'s on the same seed.
    """
    per_seed_figures = {
        "heldout_accuracy_after": lambda run: run["after"]["accuracy"],
        "heldout_reward_after": lambda run: run["after"]["reward"],
        "training_reward_mean": lambda run: statistics.mean(run["training_reward"]),
    }
    for sign in SIGNS:
        per_seed_figures[f"fig3_{sign}_share_all"] = lambda run, sign=sign: run["fig3"][sign]["all"]
        for q in range(4):
            per_seed_figures[f"fig3_{sign}_share_q{q + 1}"] = lambda run, sign=sign, q=q: run["fig3"][sign]["share"][q]
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run["name"], []).append(run)
    by_seed = {
        name: {key: {run["seed"]: figure(run) for run in group} for key, figure in per_seed_figures.items()}
        for name, group in groups.items()
    }
    summary = {}
    for name, group in groups.items():
        entry = {"seeds": [run["seed"] for run in group]}
        entry.update({key: t_interval(list(values.values())) for key, values in by_seed[name].items()})
        for metric in ("accuracy", "reward"):
            before = [run["before"][metric] for run in group]
            after = [run["after"][metric] for run in group]
            entry[f"heldout_{metric}_before"], entry[f"heldout_{metric}_after"] = t_interval(before), t_interval(after)
            entry[f"heldout_{metric}_change"] = t_interval([a - b for a, b in zip(after, before, strict=True)])
        length = min(len(run["training_reward"]) for run in group)
        entry["training_reward_curve"] = [t_interval([r["training_reward"][i] for r in group]) for i in range(length)]
        entry["fig3_pooled"] = fig3_shares([batch for run in group for batch in run["fig3_batches"]])
        for key in ("optimizer_steps", "generation_batches"):
            entry[key] = sorted({run[key] for run in group})
        for key in ("train_wall_s", "train_cpu_s", "probe_s", "parameter_distance"):
            entry[key] = t_interval([run[key] for run in group])
        if BASELINE in by_seed:
            entry["paired"] = {
                key: paired_difference(values, by_seed[BASELINE][key]) for key, values in by_seed[name].items()
            }
        summary[name] = entry
    return summary


def compare_markdown(report: dict[str, Any]) -> str:
    """The tables of a method comparison: held-out, paired differences, Fig. 3 per quartile (and paired), cost."""
    summary, settings = report["summary"], report["settings"]
    others = [name for name in summary if name != BASELINE and "paired" in summary[name]]
    quartiles = "Q1 (lowest) | Q2 | Q3 | Q4 (highest)"
    heldout = []
    for name, s in summary.items():
        steps = f"{'/'.join(map(str, s['optimizer_steps']))} / {'/'.join(map(str, s['generation_batches']))}"
        cells = [
            interval(s[f"heldout_{m}_{w}"]) for m in ("accuracy", "reward") for w in ("before", "after", "change")
        ]
        heldout.append([name, steps, *cells])
    paired_keys = [
        "heldout_accuracy_after",
        "heldout_reward_after",
        "training_reward_mean",
        "fig3_positive_share_all",
        "fig3_negative_share_all",
    ]
    paired = [[name, *(interval(summary[name]["paired"][key]) for key in paired_keys)] for name in others]
    fig3, fig3_paired = [], []
    for name, s in summary.items():
        for sign in SIGNS:
            pooled = s["fig3_pooled"][sign]
            fig3.append(
                [
                    name,
                    sign,
                    *(
                        "n/a"
                        if pooled["share"][q] is None
                        else f"{pooled['share'][q]:.3f} ({pooled['in_direction'][q]}/"
                        f"{pooled['count'][q]}); {interval(s[f'fig3_{sign}_share_q{q + 1}'])}"
                        for q in range(4)
                    ),
                ]
            )
            if name in others:
                differences = [interval(s["paired"][f"fig3_{sign}_share_q{q + 1}"]) for q in range(4)]
                fig3_paired.append([name, sign, *differences])
    cost = [
        [
            name,
            interval(s["train_wall_s"], 0),
            interval(s["train_cpu_s"], 0),
            interval(s["probe_s"], 0),
            interval(s["parameter_distance"], 4),
        ]
        for name, s in summary.items()
    ]
    env = report["environment"]
    lines = [
        f"# {' vs '.join(summary)} at equal rollouts",
        "",
        (
            f"Model: {report['model']}. Task `{settings['task']}`, reward `{settings['reward']}`. "
            f"{settings['rollout_batches']} generation batches of {settings['prompts_per_batch']} prompts x "
            f"{settings['num_generations']} completions ({settings['max_completion_length']} tokens) per run, "
            f"temperature {settings['temperature']:g}, constant lr {settings['learning_rate']:g}, seeds "
            f"{report['seeds']}. Figures: mean over seeds [95% t interval]."
        ),
        "",
        f"Command: `{report['command']}`",
        "",
        (
            f"Held-out problems ({report['num_heldout']}; greedy accuracy, and the mean reward of "
            f"{settings['eval_samples']} samples each):"
        ),
        "",
        *markdown_table(
            "method | opt. steps / gen. batches | greedy before | greedy after | change | sampled before | "
            "sampled after | change",
            heldout,
        ),
        "",
        f"Difference to `{BASELINE}` on the same seed:",
        "",
        *markdown_table(
            "method | greedy after | sampled after | mean training reward | Fig. 3: A > 0 rose | Fig. 3: A < 0 fell",
            paired,
        ),
        "",
        (
            "Fig.-3 statistic over every generation batch: share of positive-advantage tokens whose probability rose, "
            "and of negative-advantage tokens whose probability fell, after the last optimizer step trained on their "
            "batch, by `pi_old` quartile of the batch. Cells: pooled share (in direction / tokens); mean of the "
            "per-seed shares."
        ),
        "",
        *markdown_table(f"method | sign | {quartiles}", fig3),
        "",
        f"Fig.-3 shares minus `{BASELINE}`'s on the same seed:",
        "",
        *markdown_table(f"method | sign | {quartiles}", fig3_paired),
        "",
        *markdown_table("method | train wall (s) | train CPU (s) | of which Fig.-3 probe (s) | `‖θ_end − θ_0‖`", cost),
        "",
        (
            f"Machine: {env['machine']}, {env['cpu_count']} CPUs, torch threads {env['torch_threads']}, 1-minute load "
            f"average {report['load_average_at_end'][0]:.1f} at the end."
        ),
    ]
    return "\n".join(lines) + "\n"


def compare_plots(report: dict[str, Any], path: Path) -> str:
    """Training reward per batch, Fig.-3 shares per quartile (means over seeds), held-out greedy accuracy."""
    import pandas as pd

    summary = report["summary"]
    figure, axes = new_figure(2, 2, figsize=(12, 8))
    curves = {name: [point["mean"] for point in s["training_reward_curve"]] for name, s in summary.items()}
    curves = pd.DataFrame(curves, index=range(1, len(next(iter(curves.values()))) + 1))
    curves.plot(
        ax=axes[0, 0], marker="o", title="Training reward (mean over seeds)", ylim=(0, 1), xlabel="generation batch"
    )
    quartiles = ["Q1 (lowest pi_old)", "Q2", "Q3", "Q4"]
    for axis, sign, title in (
        (axes[0, 1], "positive", "A > 0: share whose probability rose"),
        (axes[1, 0], "negative", "A < 0: share whose probability fell"),
    ):
        shares = {
            name: [s[f"fig3_{sign}_share_q{q + 1}"]["mean"] or 0.0 for q in range(4)] for name, s in summary.items()
        }
        pd.DataFrame(shares, index=quartiles).plot.bar(ax=axis, title=f"Fig. 3, {title}", ylim=(0, 1), rot=0)
    accuracy = {
        when: [s[f"heldout_accuracy_{when}"]["mean"] for s in summary.values()] for when in ("before", "after")
    }
    pd.DataFrame(accuracy, index=list(summary)).plot.bar(
        ax=axes[1, 1], title="Held-out greedy accuracy", ylim=(0, 1), rot=0
    )
    return save_figure(figure, path, "Method comparison at equal rollouts")
