"""The one plotting helper of the package: figures of named series in panels (used by diagnose, demo, benchmarks)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Panel:
    """
    One panel of a figure.

    Args:
        title (`str`):
            The panel's title.
        series (`dict[str, tuple[Sequence[float], Sequence[float]]]`):
            label -> (x, y). With `kind="bar"`, x are category positions (0, 1, ...) shared by every series, whose
            bars are drawn side by side.
        kind (`str`, *optional*, defaults to `"line"`):
            `"line"` (markers on each point) or `"bar"`.
        xlabel (`str`, *optional*), ylabel (`str`, *optional*):
            Axis labels.
        xticklabels (`Sequence[str]`, *optional*):
            Labels of the category positions (bar panels).
        hlines (`dict[str, float]`, *optional*):
            label -> y of a dashed horizontal reference line.
        ylim (`tuple[float, float]`, *optional*), yscale (`str`, *optional*):
            Axis range and scale (`"log"`).
    """

    title: str
    series: dict[str, tuple[Sequence[float], Sequence[float]]]
    kind: str = "line"
    xlabel: str | None = None
    ylabel: str | None = None
    xticklabels: Sequence[str] | None = None
    hlines: dict[str, float] = field(default_factory=dict)
    ylim: tuple[float, float] | None = None
    yscale: str | None = None


def plot_panels(path: str | os.PathLike, panels: Sequence[Panel], title: str | None = None, columns: int = 2) -> str:
    """
    Writes a PNG with one panel per [`Panel`], `columns` per row.

    Args:
        path (`str` or `os.PathLike`):
            The PNG to write (its folder must exist).
        panels (`Sequence[Panel]`):
            The panels, in reading order.
        title (`str`, *optional*):
            The figure's title.
        columns (`int`, *optional*, defaults to `2`):
            Panels per row.

    Returns:
        `str`: The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for axis, panel in zip(axes.flat, panels):
        width = 0.8 / max(1, len(panel.series))
        for index, (label, (x, y)) in enumerate(panel.series.items()):
            if panel.kind == "bar":
                axis.bar([p - 0.4 + width * (index + 0.5) for p in x], y, width, label=label)
            else:
                axis.plot(x, y, marker="o", markersize=3, label=label)
        for index, (label, y) in enumerate(panel.hlines.items()):
            axis.axhline(y, linestyle="--", color=f"C{len(panel.series) + index}", label=label)
        if panel.xticklabels is not None:
            axis.set_xticks(range(len(panel.xticklabels)))
            axis.set_xticklabels(panel.xticklabels, fontsize=8)
        axis.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        if panel.ylim is not None:
            axis.set_ylim(*panel.ylim)
        if panel.yscale is not None:
            axis.set_yscale(panel.yscale)
        if len(panel.series) + len(panel.hlines) > 1:
            axis.legend(fontsize=8)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_axis_off()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)
