"""The benchmarks' one statistics helper and one report writer: medians per batch, Student-t intervals (scipy),
differences paired by seed (pandas), Markdown (`trl_lopti.diagnostics.report.markdown_table`) and plots (pandas and
matplotlib)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from trl_lopti.diagnostics.report import markdown_table, new_figure, save_figure


BASELINE = "grpo"
"""The configuration every ratio and paired difference is taken against."""

SIGNS = ("positive", "negative")
WHEN = ("before", "after", "change")


# Statistics ----------------------------------------------------------------------------------------------------------
def t_interval(values: Sequence[float | None], confidence: float = 0.95) -> dict[str, Any]:
    """
    Mean and two-sided Student-t confidence interval of the mean (`scipy.stats.t`) of `values` (one per seed;
    `None` and NaN are dropped): `mean`, `low`, `high`, `sd`, `n` (`low`, `high` and `sd` are `None` below 2 values).
    """
    from scipy import stats

    values = [float(v) for v in values if v is not None and not math.isnan(v)]
    n = len(values)
    mean = sum(values) / n if n else None
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "sd": None, "n": n}
    half_width = float(stats.t.ppf((1 + confidence) / 2, n - 1) * stats.sem(values))  # 0 where every value is equal
    return {"mean": mean, "low": mean - half_width, "high": mean + half_width, "sd": statistics.stdev(values), "n": n}


def paired_difference(values: dict[int, float | None], baseline: dict[int, float | None]) -> dict[str, Any]:
    """[`t_interval`] of `values[seed] - baseline[seed]` over the seeds where both are known (paired by seed)."""
    return t_interval(pd.Series(values, dtype=float) - pd.Series(baseline, dtype=float))


def batch_medians(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """
    Medians over the measured (non-warm-up) generation batches of a run: `measured_batches`; `wall` and `cpu`, every
    phase and `completion_tokens_per_s`; `counts`, every count (equal across batches unless a pass was skipped).
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


def run_figures(run: dict[str, Any]) -> dict[str, float | None]:
    """The figures of one comparison run (one seed), each summarised over seeds and paired with GRPO's."""
    figures = {}
    for metric in ("accuracy", "reward"):
        before, after = run["before"][metric], run["after"][metric]
        values = (before, after, after - before)
        figures |= {f"heldout_{metric}_{when}": value for when, value in zip(WHEN, values, strict=True)}
    figures["training_reward_mean"] = statistics.mean(run["training_reward"])
    for sign in SIGNS:
        figures[f"fig3_{sign}_share_all"] = run["fig3"][sign]["all"]
        figures.update({f"fig3_{sign}_share_q{q + 1}": share for q, share in enumerate(run["fig3"][sign]["share"])})
    return figures | {key: run[key] for key in ("train_wall_s", "train_cpu_s", "probe_s", "parameter_distance")}


def compare_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """
    Per method: every figure of [`run_figures`] as a t interval over seeds, the training reward per batch, the pooled
    Fig.-3 shares, and under `paired` every figure's difference to `grpo`'s on the same seed.
    """
    figures = pd.DataFrame([{"name": run["name"], "seed": run["seed"], **run_figures(run)} for run in runs])
    figures = figures.set_index(["name", "seed"]).astype(float)
    summary = {}
    for name in dict.fromkeys(run["name"] for run in runs):
        group, own = [run for run in runs if run["name"] == name], figures.loc[name]
        length = min(len(run["training_reward"]) for run in group)
        summary[name] = {
            "seeds": [run["seed"] for run in group],
            **{key: t_interval(own[key]) for key in own},
            "training_reward_curve": [t_interval([r["training_reward"][i] for r in group]) for i in range(length)],
            "fig3_pooled": fig3_shares([batch for run in group for batch in run["fig3_batches"]]),
            "optimizer_steps": sorted({run["optimizer_steps"] for run in group}),
            "generation_batches": sorted({run["generation_batches"] for run in group}),
        }
        if BASELINE in figures.index:
            paired = own - figures.loc[BASELINE]  # aligned by seed: NaN where either is missing
            summary[name]["paired"] = {key: t_interval(paired[key]) for key in own}
    return summary


# Markdown ------------------------------------------------------------------------------------------------------------
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
    ratios in parentheses to the run's `baseline` (TRL's trainer it extends: `grpo`, `rloo`), the counted passes and
    peak memory; then the conditions of the run.
    """
    runs, size, env = report["runs"], report["size"], report["environment"]
    on_gpu, by_name = size["device"] == "cuda", {run["name"]: run for run in runs}

    def with_ratio(value: float, reference: float | None, digits: int) -> str:
        return f"{value:.{digits}f}" + (f" ({value / reference:.2f}x)" if reference else "")

    memory = "peak CUDA mem (MB)" if on_gpu else "peak RSS (MB)"
    header = (
        "configuration | step (s) | generation (s) | scoring (s) | loss+bwd+opt (s) | fwd grad / no-grad | bwd | "
        f"opt steps | {memory} | compl. tok/s | fact checks (share of step)"
    )
    timed = [("step_s", 2), ("generation_s", 2), ("scoring_s", 3), ("loss_backward_optimizer_s", 2)]
    lines = []
    for clock, title in [("wall", "Wall-clock time"), ("cpu", "Process CPU time (all threads)")][: 1 if on_gpu else 2]:
        rows = []
        for run in runs:
            medians, counts = run["medians"][clock], run["medians"]["counts"]
            base = by_name.get(run.get("baseline", BASELINE))  # (older files: no baseline, every ratio to grpo)
            reference = base["medians"][clock] if base and run is not base else {}
            rows.append(
                [
                    f"{run['name']}: {run['method']}",
                    *(with_ratio(medians[key], reference.get(key), digits) for key, digits in timed),
                    f"{counts['policy_forwards_grad']:g} / {counts['policy_forwards_no_grad']:g}",
                    f"{counts['backward_passes']:g}",
                    f"{counts['optimizer_steps']:g}",
                    with_ratio(run["peak_memory_mb"], base["peak_memory_mb"] if reference else None, 0),
                    with_ratio(medians["completion_tokens_per_s"], reference.get("completion_tokens_per_s"), 1),
                    f"{100 * medians.get('fact_checks_s', 0.0) / medians['step_s']:.2f}%",
                ]
            )
        lines += [f"{title} per generation batch (median):", "", *markdown_table(header, rows), ""]
    lines += over_base_markdown(runs, on_gpu)
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
        f"steps (on-policy), {env['device']}, {'bf16 autocast' if on_gpu else 'float32'}, gradient checkpointing "
        f"{'on' if size['gradient_checkpointing'] else 'off'}, torch threads {env['torch_threads']}. "
        f"Medians over {runs[0]['medians']['measured_batches'] if runs else 0} generation batches after "
        f"{size['warmup_batches']} warm-up batch(es) per configuration. "
        f"Lopti threshold {report['lopti_threshold']:.4g}{low_token_share}. "
        f"1-minute load average {env['load_average'][0]:.1f} at the start and "
        f"{report['load_average_at_end'][0]:.1f} at the end on {env['cpu_count']} CPUs."
    )
    if report["skipped"]:
        conditions += " Skipped: " + ", ".join(report["skipped"]) + "."
    return "\n".join([*lines, conditions]) + "\n"


def over_base_markdown(runs: Sequence[dict[str, Any]], on_gpu: bool) -> list[str]:
    """
    The table of every run over its own base (`baseline`, TRL's trainer it extends) in the same file, the runs of the
    same settings on different bases side by side (`ar+lopti` / `grpo` beside `gmpo-ar+lopti` / `gmpo`): medians per
    generation batch of the step and of loss+bwd+opt as ratios (wall; on CPU also process CPU time), and the counted
    passes against the base's. `extra forwards` counts the policy forwards outside generation beyond one gradient
    forward per micro-batch per pass (passes: optimizer steps over the base's) and beyond the base's own no-grad
    forwards. Empty where no run has its base in the file.
    """
    by_name = {run["name"]: run for run in runs}
    pairs = {}
    for run in runs:
        base = by_name.get(run.get("baseline", BASELINE))
        if base is not None and run is not base:
            # The settings of the run, whatever its base: `gmpo-ar+lopti` and `ar+lopti` are both `ar+lopti`.
            settings = run["name"].removeprefix(f"{base['name']}-")
            pairs.setdefault(settings, []).append((run, base))
    if not pairs:
        return []
    clocks = {"wall": "wall"} if on_gpu else {"wall": "wall", "cpu": "CPU"}
    phases = {"step_s": "step", "loss_backward_optimizer_s": "loss+bwd+opt"}
    timed = [(clock, key, f"{phase}, {name}") for key, phase in phases.items() for clock, name in clocks.items()]
    columns = ["run / its base", *(label for _, _, label in timed), "fwd grad", "fwd no-grad", "extra forwards"]
    header = " | ".join([*columns, "bwd", "opt steps"])
    rows = []
    for group in pairs.values():
        for run, base in group:
            counts, base_counts = run["medians"]["counts"], base["medians"]["counts"]
            passes = counts["optimizer_steps"] / base_counts["optimizer_steps"]
            extra = counts["policy_forwards_grad"] - passes * base_counts["policy_forwards_grad"]
            extra += counts["policy_forwards_no_grad"] - base_counts["policy_forwards_no_grad"]
            rows.append(
                [
                    f"{run['name']} / {base['name']}",
                    *(f"{run['medians'][clock][key] / base['medians'][clock][key]:.2f}x" for clock, key, _ in timed),
                    *(
                        f"{counts[key]:g} vs {base_counts[key]:g}"
                        for key in ("policy_forwards_grad", "policy_forwards_no_grad")
                    ),
                    "none" if extra == 0 else f"{extra:+g}",
                    *(f"{counts[key]:g} vs {base_counts[key]:g}" for key in ("backward_passes", "optimizer_steps")),
                ]
            )
    title = (
        "Each configuration over its own base trainer (median per generation batch; settings side by side across "
        "bases):"
    )
    return [title, "", *markdown_table(header, rows), ""]


def compare_markdown(report: dict[str, Any]) -> str:
    """The tables of a method comparison: held-out figures, Fig. 3 per quartile, cost; each with its difference to
    `grpo` on the same seed."""
    summary, settings, env = report["summary"], report["settings"], report["environment"]

    def tables(title: str, header: str, keys: list[str]) -> list[str]:
        rows = [[name, *(interval(s[key]) for key in keys)] for name, s in summary.items()]
        paired = [
            [name, *(interval(s["paired"][key]) for key in keys)] for name, s in summary.items() if "paired" in s
        ]
        differences = markdown_table(f"method | {header}", [row for row in paired if row[0] != BASELINE])
        table = markdown_table(f"method | {header}", rows)
        return [f"{title}:", "", *table, "", f"Minus `{BASELINE}`'s on the same seed:", "", *differences, ""]

    steps = ", ".join(f"{name} {s['optimizer_steps']} / {s['generation_batches']}" for name, s in summary.items())
    quartiles = "Q1 (lowest) | Q2 | Q3 | Q4 (highest) | all"
    lines = [
        f"# {' vs '.join(summary)} at equal rollouts",
        "",
        (
            f"Model: {report['model']}. Task `{settings['task']}`, reward `{settings['reward']}`. "
            f"{settings['rollout_batches']} generation batches of {settings['prompts_per_batch']} prompts x "
            f"{settings['num_generations']} completions ({settings['max_completion_length']} tokens) per run, "
            f"temperature {settings['temperature']:g}, constant lr {settings['learning_rate']:g}, seeds "
            f"{report['seeds']}; optimizer steps / generation batches: {steps}. Figures: mean over seeds [95% t]."
        ),
        "",
        f"Command: `{report['command']}`",
        "",
        *tables(
            f"Held-out problems ({report['num_heldout']}; greedy accuracy, and the mean reward of "
            f"{settings['eval_samples']} samples each)",
            "greedy before | greedy after | change | sampled before | sampled after | change | mean training reward",
            [f"heldout_{metric}_{when}" for metric in ("accuracy", "reward") for when in WHEN]
            + ["training_reward_mean"],
        ),
    ]
    for sign, moved in zip(SIGNS, ("rose", "fell"), strict=True):
        title = (
            f"Fig.-3 statistic: share of {sign}-advantage tokens whose probability {moved} after the last optimizer "
            "step trained on their batch, by `pi_old` quartile of the batch (per-seed shares; pooled counts in the JSON)"
        )
        keys = [f"fig3_{sign}_share_q{q}" for q in range(1, 5)] + [f"fig3_{sign}_share_all"]
        lines += tables(title, quartiles, keys)
    cost_keys = ["train_wall_s", "train_cpu_s", "probe_s", "parameter_distance"]
    lines += tables("Cost", "train wall (s) | train CPU (s) | of which Fig.-3 probe (s) | `‖θ_end − θ_0‖`", cost_keys)
    lines.append(
        f"Machine: {env['machine']}, {env['cpu_count']} CPUs, torch threads {env['torch_threads']}, 1-minute load "
        f"average {report['load_average_at_end'][0]:.1f} at the end."
    )
    return "\n".join(lines) + "\n"


def compare_plots(report: dict[str, Any], path: Path) -> str:
    """Training reward per batch, Fig.-3 shares per quartile, held-out greedy accuracy (means over seeds)."""
    summary = report["summary"]
    means = pd.DataFrame(
        {name: {key: stat["mean"] for key, stat in s.items() if "mean" in stat} for name, s in summary.items()}
    )
    curves = pd.DataFrame(
        {name: [point["mean"] for point in s["training_reward_curve"]] for name, s in summary.items()}
    )
    curves.index += 1
    figure, axes = new_figure(2, 2, figsize=(12, 8))
    curves.plot(ax=axes[0, 0], marker="o", title="Training reward", ylim=(0, 1), xlabel="generation batch")
    for axis, sign, moved in ((axes[0, 1], "positive", "rose"), (axes[1, 0], "negative", "fell")):
        shares = means.loc[[f"fig3_{sign}_share_q{q}" for q in range(1, 5)]]
        title = f"Fig. 3: share of {sign}-advantage tokens whose probability {moved}"
        shares.set_axis(["Q1 (lowest pi_old)", "Q2", "Q3", "Q4"]).plot.bar(ax=axis, title=title, ylim=(0, 1), rot=0)
    accuracy = means.loc[[f"heldout_accuracy_{when}" for when in WHEN[:2]]].set_axis(WHEN[:2]).T
    accuracy.plot.bar(ax=axes[1, 1], title="Held-out greedy accuracy", ylim=(0, 1), rot=0)
    return save_figure(figure, path, "Method comparison at equal rollouts (means over seeds)")
