"""PNG charts of replay reports (matplotlib, headless: the Agg backend, nothing opens a window)."""

from __future__ import annotations

from collections import defaultdict

from .errors import ConfigError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("charts need matplotlib: pip install 'kvcluster[plots]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path)
    fig.clf()
    _pyplot().close(fig)


def plot_hit_rates(report: dict, path: str) -> None:
    """Hit rate vs capacity for each policy; Belady and the infinite cache as reference lines."""
    plt = _pyplot()
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
    if all(x > 0 for points in series.values() for x, _ in points):
        ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("prefix-token hit rate")
    ax.set_title(f"{report['trace']}: {report['requests']:,} requests, {report['block_refs']:,} block refs")
    ax.grid(True, alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_tier_occupancy(runs: list[dict], path: str, title: str) -> None:
    """Per policy run: the fraction of each tier's capacity in use, over trace time (or request index)."""
    plt = _pyplot()
    runs = [r for r in runs if "deployment" not in r] or runs
    fig, axes = plt.subplots(len(runs), 1, figsize=(9.5, 2.4 * len(runs) + 0.8), dpi=120, sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        occ = run["occupancy"]
        timed = len(occ["arrival_s"]) > 1 and occ["arrival_s"][-1] > occ["arrival_s"][0]
        xs = occ["arrival_s"] if timed else occ["request"]
        for name, tier in occ["tiers"].items():
            cap = max(1, tier["capacity_blocks"])
            ax.plot(xs, [b / cap for b in tier["blocks"]], label=f"{name} ({tier['capacity_blocks']:,} blocks)")
        ax.set_ylim(-0.02, 1.05)
        ax.set_ylabel("fraction full")
        ax.set_title(f"{run['label']}: hit rate {run['hit_rate']:.3f}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1, 0].set_xlabel("trace time (s)" if timed else "request")
    fig.suptitle(f"tier occupancy: {title}", fontsize=11)
    _save(fig, path)


def _seconds(s: float) -> str:
    return f"{s:,.1f} s" if s >= 10 else f"{s * 1e3:,.1f} ms"


def plot_ttft_distribution(runs: list[dict], path: str, title: str) -> None:
    """Histogram of every request's projected TTFT per run (log-spaced bins shared by all runs)."""
    import numpy as np

    plt = _pyplot()
    values = {r["label"]: np.asarray(r.get("ttft_s_values") or [], dtype=float) * 1e3 for r in runs}
    positive = np.concatenate([v[v > 0] for v in values.values()] or [np.zeros(0)])
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    if positive.size:
        lo, hi = positive.min(), positive.max()
        bins = np.geomspace(lo, hi * 1.0001 if hi > lo else lo * 10, 41)
        ax.set_xscale("log")
    else:
        bins = 40
    for run in runs:
        v = values[run["label"]]
        if not v.size:
            continue
        hist = run.get("ttft_histogram_s", {})
        zeros = int((v <= 0).sum())
        label = f"{run['label']}: p50 {_seconds(hist.get('p50', 0))}, p99 {_seconds(hist.get('p99', 0))}"
        if zeros:
            label += f" ({zeros} at 0 not drawn)"
        style = {"linestyle": "--"} if "deployment" in run else {}
        ax.hist(v[v > 0] if positive.size else v, bins=bins, histtype="step", linewidth=1.5, label=label, **style)
    ax.set_xlabel("projected TTFT (ms)")
    ax.set_ylabel("requests")
    ax.set_title(f"TTFT distribution: {title}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
