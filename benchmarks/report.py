"""The benchmarks' one statistics helper and one report writer: medians per batch, Student-t intervals, markdown, plots.

Plots go through the package's one plotting helper, `trl_lopti.diagnostics.plots.plot_panels`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


BASELINE = "grpo"
"""The configuration every ratio and paired difference is taken against."""

SIGNS = ("positive", "negative")


# ---------------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------------
def t_interval(values: Sequence[float | None], confidence: float = 0.95) -> dict[str, Any]:
    """
    Mean and two-sided Student-t confidence interval of the mean, `mean +- t_{(1+c)/2, n-1} * sd / sqrt(n)`.

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
    sd = statistics.stdev(values)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "sd": sd, "n": n}


def paired_difference(values: dict[int, float | None], baseline: dict[int, float | None]) -> dict[str, Any]:
    """[`t_interval`] of `values[seed] - baseline[seed]` over the seeds where both are known (paired by seed)."""
    return t_interval([values[s] - baseline[s] for s in values
                       if s in baseline and values[s] is not None and baseline[s] is not None])  # fmt: skip


def batch_medians(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """
    Medians over the measured (non-warm-up) generation batches of a run, or of several runs pooled.

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
    counts = [key for key, value in measured[0].items() if isinstance(value, int) and key != "warmup"]
    medians["counts"] = {key: statistics.median(batch[key] for batch in measured) for key in counts}
    return medians


def logged_mean(batches: Sequence[dict[str, Any]], key: str) -> float | None:
    """The mean of a logged metric over every value logged in these batches (`None` if never logged)."""
    values = [value for batch in batches for value in batch["logged"].get(key, [])]
    return sum(values) / len(values) if values else None


def fig3_shares(fig3_batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sums Fig.-3 counts over batches; per sign: `count`, `in_direction`, `share` per quartile, and `all`."""
    pooled = {}
    for sign in SIGNS:
        count = [sum(b[sign]["count"][q] for b in fig3_batches) for q in range(4)]
        hits = [sum(b[sign]["in_direction"][q] for b in fig3_batches) for q in range(4)]
        pooled[sign] = {"count": count, "in_direction": hits, "share": [h / c if c else None for h, c in zip(hits, count)],
                        "all": sum(hits) / sum(count) if sum(count) else None}  # fmt: skip
    return pooled


# ---------------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------------
def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


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
    with ratios to `grpo`, the counted passes and peak memory, then the conditions of the run.
    """
    runs, size, env = report["runs"], report["size"], report["environment"]
    on_gpu = size["device"] == "cuda"
    base = next((r for r in runs if r["name"] == BASELINE), None)
    lines = []
    for clock, title in (("wall", "Wall-clock time"), ("cpu", "Process CPU time (all threads)"))[: 1 if on_gpu else 2]:
        def cell(run, key, digits=2):
            value, reference = run["medians"][clock][key], base["medians"][clock][key] if base else None
            text = f"{value:.{digits}f}"
            return text if run is base or not reference else f"{text} ({value / reference:.2f}x)"

        rows = []
        for run in runs:
            counts, memory = run["medians"]["counts"], run["peak_memory_mb"]
            if base and run is not base:
                memory = f"{memory:.0f} ({memory / base['peak_memory_mb']:.2f}x)"
            rows.append([f"{run['name']}: {run['description']}", cell(run, "step_s"), cell(run, "generation_s"),
                         cell(run, "scoring_s", 3), cell(run, "loss_backward_optimizer_s"),
                         f"{counts['policy_forwards_grad']:g} / {counts['policy_forwards_no_grad']:g}",
                         f"{counts['backward_passes']:g}", f"{counts['optimizer_steps']:g}",
                         memory if isinstance(memory, str) else f"{memory:.0f}",
                         cell(run, "completion_tokens_per_s", 1)])  # fmt: skip
        header = ["configuration", "step (s)", "generation (s)", "scoring (s)", "loss+bwd+opt (s)", "fwd grad / no-grad",
                  "bwd", "opt steps", "peak CUDA mem (MB)" if on_gpu else "peak RSS (MB)", "compl. tok/s"]  # fmt: skip
        lines += [f"{title} per generation batch (median):", "", *table(header, rows), ""]
    shares = [s for s in (logged_mean(r["batches"], "lopti/low_token_share") for r in runs) if s is not None]
    load = report["load_average_at_start"][0], report["load_average_at_end"][0]
    lines.append(
        f"Size `{size['name']}`: model `{report['model']}`, {size['prompts_per_batch']} prompts x "
        f"{size['num_generations']} completions of {size['max_completion_length']} tokens per generation batch, "
        f"micro-batch {size['per_device_train_batch_size']} x {size['gradient_accumulation_steps']} accumulation steps "
        f"(on-policy), {env['device']}, {'bf16 autocast' if size['bf16'] else 'float32'}, gradient checkpointing "
        f"{'on' if size['gradient_checkpointing'] else 'off'}, torch threads {env['torch_threads']}. Medians over "
        f"{runs[0]['medians']['measured_batches'] if runs else 0} generation batches"
        + (f" pooled from {report['pooled_from']} runs" if report.get("pooled_from") else "")
        + f" after {size['warmup_batches']} warm-up batch(es) per run. Lopti threshold {report['lopti_threshold']:.4g}"
        + (f", low-token share {statistics.median(shares):.2f}" if shares else "")
        + f". 1-minute load average {load[0]:.1f} at the start and {load[1]:.1f} at the end on {env['cpu_count']} CPUs."
        + (" Skipped: " + ", ".join(report["skipped"]) + "." if report.get("skipped") else "")
    )
    return "\n".join(lines) + "\n"


def compare_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per method: intervals over seeds, pooled Fig.-3 shares, and differences to `grpo` paired by seed."""
    metrics = {
        "heldout_accuracy_after": lambda r: r["after"]["accuracy"],
        "heldout_reward_after": lambda r: r["after"]["reward"],
        "training_reward_mean": lambda r: statistics.mean(r["training_reward"]),
        **{f"fig3_{sign}_share_q{q + 1}": (lambda r, s=sign, q=q: r["fig3"][s]["share"][q])
           for sign in SIGNS for q in range(4)},  # fmt: skip
        **{f"fig3_{sign}_share_all": (lambda r, s=sign: r["fig3"][s]["all"]) for sign in SIGNS},
    }
    by_method: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_method.setdefault(run["name"], []).append(run)
    per_seed = {name: {key: {r["seed"]: f(r) for r in group} for key, f in metrics.items()}
                for name, group in by_method.items()}  # fmt: skip
    summary = {}
    for name, group in by_method.items():
        entry = {"seeds": [r["seed"] for r in group], **{key: t_interval(v.values()) for key, v in per_seed[name].items()}}
        for metric in ("accuracy", "reward"):
            for when in ("before", "after"):
                entry[f"heldout_{metric}_{when}"] = t_interval([r[when][metric] for r in group])
            entry[f"heldout_{metric}_change"] = t_interval([r["after"][metric] - r["before"][metric] for r in group])
        length = min(len(r["training_reward"]) for r in group)
        entry["training_reward_curve"] = [t_interval([r["training_reward"][i] for r in group]) for i in range(length)]
        entry["fig3_pooled"] = fig3_shares([b for r in group for b in r["fig3_batches"]])
        for key in ("optimizer_steps", "generation_batches"):
            entry[key] = sorted({r[key] for r in group})
        for key in ("train_wall_s", "train_cpu_s", "probe_s", "parameter_distance"):
            entry[key] = t_interval([r[key] for r in group])
        if BASELINE in per_seed:
            entry["paired"] = {key: paired_difference(values, per_seed[BASELINE][key])
                               for key, values in per_seed[name].items()}  # fmt: skip
        summary[name] = entry
    return summary


def compare_markdown(report: dict[str, Any]) -> str:
    """The tables of a method comparison: held-out, paired differences, Fig. 3 per quartile, cost."""
    summary, settings = report["summary"], report["settings"]
    others = [name for name in summary if name != BASELINE and "paired" in summary[name]]
    quartiles = ["Q1 (lowest)", "Q2", "Q3", "Q4 (highest)"]
    lines = [
        f"# {' vs '.join(summary)} at equal rollouts",
        "",
        f"Model: {report['model']}. Task `{settings['task']}`, reward `{settings['reward']}`. "
        f"{settings['rollout_batches']} generation batches of {settings['prompts_per_batch']} prompts x "
        f"{settings['num_generations']} completions ({settings['max_completion_length']} tokens) per run, temperature "
        f"{settings['temperature']:g}, constant lr {settings['learning_rate']:g}, seeds {report['seeds']}. Figures: "
        f"mean over seeds [95% t interval].",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Held-out problems ({report['num_heldout']}; greedy accuracy, and mean reward of {settings['eval_samples']} "
        "samples each):",
        "",
        *table(["method", "opt. steps / gen. batches", "greedy before", "greedy after", "change", "sampled before",
                "sampled after", "change"],
               [[name, f"{'/'.join(map(str, s['optimizer_steps']))} / {'/'.join(map(str, s['generation_batches']))}",
                 *(interval(s[f"heldout_{m}_{w}"]) for m in ("accuracy", "reward") for w in ("before", "after", "change"))]
                for name, s in summary.items()]),  # fmt: skip
        "",
        f"Difference to `{BASELINE}` on the same seed (mean [95% t]):",
        "",
        *table(["method", "greedy after", "sampled after", "mean training reward", "Fig. 3 A > 0 rose",
                "Fig. 3 A < 0 fell"],
               [[name, *(interval(summary[name]["paired"][k]) for k in ("heldout_accuracy_after", "heldout_reward_after",
                 "training_reward_mean", "fig3_positive_share_all", "fig3_negative_share_all"))] for name in others]),
        "",
        "Fig.-3 statistic, every generation batch: share of positive-advantage tokens whose probability rose, and of "
        "negative-advantage tokens whose probability fell, after the last optimizer step trained on their batch, by "
        "`pi_old` quartile of the batch. Cells: pooled share (in direction / tokens); mean of the per-seed shares "
        "[95% t].",
        "",
        *table(["method", "sign", *quartiles],
               [[name, sign, *(f"{p['share'][q]:.3f} ({p['in_direction'][q]}/{p['count'][q]}); "
                               f"{interval(s[f'fig3_{sign}_share_q{q + 1}'])}" if p["share"][q] is not None else "n/a"
                               for q in range(4))]
                for name, s in summary.items() for sign in SIGNS for p in [s["fig3_pooled"][sign]]]),  # fmt: skip
        "",
        f"Fig.-3 shares minus `{BASELINE}`'s on the same seed (mean [95% t]):",
        "",
        *table(["method", "sign", *quartiles],
               [[name, sign, *(interval(summary[name]["paired"][f"fig3_{sign}_share_q{q + 1}"]) for q in range(4))]
                for name in others for sign in SIGNS]),  # fmt: skip
        "",
        *table(["method", "train wall (s)", "train CPU (s)", "of which Fig.-3 probe wall (s)", "`‖θ_end − θ_0‖`"],
               [[name, interval(s["train_wall_s"], 0), interval(s["train_cpu_s"], 0), interval(s["probe_s"], 0),
                 interval(s["parameter_distance"], 4)] for name, s in summary.items()]),  # fmt: skip
        "",
        f"Machine: {report['environment']['machine']}, {report['environment']['cpu_count']} CPUs, torch threads "
        f"{report['environment']['torch_threads']}, load average {report['load_average_at_end'][0]:.1f} at the end.",
    ]
    return "\n".join(lines) + "\n"


def compare_plots(report: dict[str, Any], path: Path) -> str:
    """Training reward (mean, and paired difference to `grpo`), Fig.-3 shares per quartile, held-out before/after."""
    from trl_lopti.diagnostics.plots import Panel, plot_panels

    summary = report["summary"]
    curve = {name: (list(range(1, len(s["training_reward_curve"]) + 1)), [c["mean"] for c in s["training_reward_curve"]])
             for name, s in summary.items()}  # fmt: skip
    by_seed = {}
    for run in report["runs"]:
        by_seed.setdefault(run["name"], {})[run["seed"]] = run["training_reward"]
    paired = {}
    for name in summary:
        if name != BASELINE and BASELINE in by_seed:
            seeds = [s for s in by_seed[name] if s in by_seed[BASELINE]]
            steps = range(min(len(by_seed[name][s]) for s in seeds)) if seeds else range(0)
            paired[f"{name} - {BASELINE}"] = ([i + 1 for i in steps], [statistics.mean(
                by_seed[name][s][i] - by_seed[BASELINE][s][i] for s in seeds) for i in steps])  # fmt: skip
    panels = [
        Panel("Training reward (mean over seeds)", curve, xlabel="generation batch", ylabel="reward", ylim=(0, 1)),
        Panel(f"Training reward minus {BASELINE}'s, same seed", paired, xlabel="generation batch",
              hlines={"0": 0.0}),
    ]
    for sign, verb in (("positive", "rose"), ("negative", "fell")):
        panels.append(Panel(f"Fig. 3: A {'>' if sign == 'positive' else '<'} 0, share whose probability {verb}",
                            {name: ([0, 1, 2, 3], [s[f"fig3_{sign}_share_q{q + 1}"]["mean"] or 0.0 for q in range(4)])
                             for name, s in summary.items()}, kind="bar", ylim=(0, 1),
                            xticklabels=["Q1 (lowest pi_old)", "Q2", "Q3", "Q4"]))  # fmt: skip
    panels.append(Panel("Held-out greedy accuracy", {when: (list(range(len(summary))), [
        s[f"heldout_accuracy_{when}"]["mean"] for s in summary.values()]) for when in ("before", "after")},
        kind="bar", ylim=(0, 1), xticklabels=list(summary)))  # fmt: skip
    return plot_panels(path, panels, title="Method comparison at equal rollouts")
