"""PNG charts of replay reports (matplotlib, headless)."""

from __future__ import annotations

from collections import defaultdict


def plot_hit_rates(report: dict, path: str) -> None:
    """Hit rate vs capacity for each policy; Belady and the infinite cache as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in report["results"]:
        series[row["policy"]].append((row["capacity_blocks"], row["hit_rate"]))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for policy, points in sorted(series.items()):
        points.sort()
        xs, ys = zip(*points)
        style = {"linestyle": "--", "color": "black"} if policy == "belady" else {"marker": "o"}
        ax.plot(xs, ys, label=policy, **style)
    ax.axhline(report["infinite_hit_rate"], color="grey", linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("prefix-token hit rate")
    ax.set_title(f"{report['trace']}: {report['requests']:,} requests, {report['block_refs']:,} block refs")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
