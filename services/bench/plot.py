"""Reports as PNGs: throughput (tokens/s, TPOT and TTFT vs concurrency, TPOT vs length) and
drafter scaling (drafting time and state bytes vs context)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LABELS = {"ar": "plain (ar)", "spec": "speculative"}


def _series(stages: list[dict[str, Any]], key: str, stat: str | None = None):
    xs, ys = [], []
    for row in stages:
        value = row[key] if stat is None else (row[key] or {}).get(stat)
        if value is not None:
            xs.append(row["value"])
            ys.append(value)
    return xs, ys


def plot_throughput(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0][0], "output_tokens_per_s", None, "output tokens/s"),
        (axes[0][1], "tpot_ms", "p50", "TPOT p50 (ms)"),
        (axes[1][0], "ttft_ms", "p50", "TTFT p50 (ms)"),
    ]
    for mode, result in report["modes"].items():
        load = [r for r in result["stages"] if r["stage"].startswith("C=")]
        long = [r for r in result["stages"] if r["stage"].startswith("prompt_len=")]
        label = LABELS.get(mode, mode)
        for ax, key, stat, title in panels:
            ax.plot(*_series(load, key, stat), marker="o", label=label)
            ax.set(title=title, xlabel="concurrency", xscale="log")
        if long:
            axes[1][1].plot(*_series(long, "tpot_ms", "p50"), marker="o", label=label)
            axes[1][1].set(title="TPOT p50 (ms) at C=1", xlabel="prompt tokens", xscale="log")
        elif mode == "spec":
            axes[1][1].plot(*_series(load, "tau"), marker="o", label="tau")
            axes[1][1].set(title="mean accepted length (tau)", xlabel="concurrency", xscale="log")
    for ax in axes.flat:
        ticks = sorted({int(x) for line in ax.get_lines() for x in line.get_xdata()})
        if ticks:
            ax.minorticks_off()
            ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.suptitle(f"longspark bench throughput: {report.get('model')}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_drafter(report: dict[str, Any], path: str | Path) -> None:
    """``bench drafter``: median propose() time and state bytes vs context, per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, state_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, by_context in report["results"].items():
        contexts = sorted(by_context, key=int)
        xs = [int(c) for c in contexts]
        time_ax.plot(xs, [by_context[c]["median_ms"] for c in contexts], marker="o", label=name)
        state_ax.plot(xs, [by_context[c]["state_bytes"] for c in contexts], marker="o", label=name)
    time_ax.set(title="propose() median (ms)", xlabel="context (tokens)", xscale="log")
    state_ax.set(
        title="drafter state (bytes)", xlabel="context (tokens)", xscale="log", yscale="log"
    )
    for ax in (time_ax, state_ax):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(report.get("benchmark", "bench drafter"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
