"""Pictures of a run (matplotlib, PNG). Each function writes one file and returns the
labels of the series it drew, so callers and tests can see what is in the picture."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ferry.bench.runner import BenchRun
from ferry.bench.sweep import slo_field

# Request states on the timeline, in drawing order, with their colours.
STATES = {
    "not arrived": "#ffffff",
    "waiting": "#c8c8c8",
    "prefill chunk": "#1f77b4",
    "decode": "#2ca02c",
    "preempted": "#d62728",
    "idle slot (finished, slot held)": "#ff7f0e",
    "finished": "#eef3fa",
}
_CODE = {name: i for i, name in enumerate(STATES)}
DPI = 80


def _plt():
    """matplotlib's pyplot, drawing to files; without matplotlib, an error naming the 'bench' extra."""
    from ferry.extras import require

    matplotlib = require("matplotlib", "plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    _plt().close(fig)


def timeline_grid(run: BenchRun) -> np.ndarray:
    """requests x steps array of state codes (index into STATES), rows in arrival order."""
    outs = sorted(run.outputs, key=lambda o: o.metrics.arrival_time)
    row = {o.request_id: i for i, o in enumerate(outs)}
    arrival = np.array([o.metrics.arrival_time for o in outs])
    finished = np.array([o.metrics.finished_time if o.metrics.finished_time is not None else np.inf
                         for o in outs])
    grid = np.empty((len(outs), len(run.steps)), dtype=np.int8)
    preempted = np.zeros(len(outs), dtype=bool)
    for k, s in enumerate(run.steps):
        col = np.where(finished <= s.start, _CODE["finished"],
                       np.where(arrival <= s.start, _CODE["waiting"], _CODE["not arrived"]))
        for rid in s.preempted_ids:
            preempted[row[rid]] = True
        col = np.where(preempted & (col == _CODE["waiting"]), _CODE["preempted"], col)
        for ids, state in ((s.prefill_ids, "prefill chunk"), (s.decode_ids, "decode"),
                           (s.padding_ids, "idle slot (finished, slot held)")):
            for rid in ids:
                col[row[rid]] = _CODE[state]
                preempted[row[rid]] = False
        grid[:, k] = col
    return grid


def plot_timeline(run: BenchRun, path: str | Path) -> list[str]:
    """One row per request, one column per step, coloured by state: the familiar pictures of
    static and continuous batching (vLLM's blog, Orca), drawn from a real run."""
    plt = _plt()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    grid = timeline_grid(run)
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.08 * grid.shape[0]))
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(list(STATES.values())),
              vmin=0, vmax=len(STATES) - 1)
    ax.set_xlabel("step")
    ax.set_ylabel("request (by arrival)")
    ax.set_title(f"request timeline: {run.label}")
    labels = list(STATES)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#888888", label=n) for n, c in STATES.items()],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    _save(fig, path)
    return labels


def plot_steps(run: BenchRun, path: str | Path) -> list[str]:
    """Per step: decode and prefill tokens stacked against the budget, and the step's time."""
    plt = _plt()
    x = np.arange(len(run.steps))
    dec = np.array([s.num_decode_tokens for s in run.steps])
    pre = np.array([s.num_prefill_tokens for s in run.steps])
    pad = np.array([s.num_padding_tokens for s in run.steps])
    fig, ax = plt.subplots(figsize=(10, 3.5))
    labels = ["decode tokens", "prefill tokens"]
    ax.bar(x, dec, width=1.0, color=STATES["decode"], label=labels[0])
    ax.bar(x, pre, width=1.0, bottom=dec, color=STATES["prefill chunk"], label=labels[1])
    if pad.any():
        labels.append("idle slots (static padding)")
        ax.bar(x, pad, width=1.0, bottom=dec + pre, color=STATES["idle slot (finished, slot held)"],
               label=labels[-1])
    if run.config.scheduler == "continuous":
        labels.append("token budget")
        ax.axhline(run.config.max_num_batched_tokens, color="k", ls="--", lw=1, label=labels[-1])
    ax.set_xlabel("step")
    ax.set_ylabel("tokens in step")
    ax2 = ax.twinx()
    labels.append("step time")
    ax2.plot(x, [s.duration * 1e3 for s in run.steps], color="#9467bd", lw=0.8, label=labels[-1])
    ax2.set_ylabel("step time (ms)")
    ax2.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    ax.set_title(f"tokens per step: {run.label}")
    _save(fig, path)
    return labels


def plot_kv(run: BenchRun, path: str | Path) -> list[str]:
    """KV blocks in use over time, with the capacity and every preemption marked."""
    plt = _plt()
    t = np.array([s.start - run.start for s in run.steps])
    used = np.array([s.num_kv_blocks_used for s in run.steps])
    fig, ax = plt.subplots(figsize=(10, 3))
    labels = ["KV blocks in use", "KV capacity"]
    ax.step(t, used, where="post", label=labels[0])
    ax.axhline(run.num_kv_blocks, color="k", ls="--", lw=1, label=labels[1])
    pre = np.array([s.num_preempted > 0 for s in run.steps], dtype=bool)
    if pre.any():
        labels.append("preemption")
        ax.scatter(t[pre], used[pre], marker="v", color=STATES["preempted"], zorder=3, label=labels[-1])
    ax.set_xlabel("time (s)")
    ax.set_ylabel("blocks")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"KV cache: {run.label}")
    _save(fig, path)
    return labels


def plot_cdfs(runs: Sequence[BenchRun], path: str | Path) -> list[str]:
    """CDFs of TTFT, TPOT and ITL: one curve per run, to compare configurations."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, name in zip(axes, ("ttft", "tpot", "itl")):
        for run in runs:
            v = np.sort(np.array(run.metrics.samples.get(name, []))) * 1e3
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=run.label)
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests / tokens")
    axes[-1].legend(fontsize=8, loc="lower right")
    _save(fig, path)
    return [r.label for r in runs]


def plot_sweep(points: list[dict], path: str | Path, group_by: Sequence[str], vary: str,
               slo: dict[str, float] | None = None, best: dict | None = None) -> list[str]:
    """Throughput against p99 TPOT and p99 TTFT for each configuration of a sweep.

    Points with the same ``group_by`` settings form one curve along ``vary``; the SLO
    limits are drawn as lines and the best configuration that meets them is circled.
    """
    plt = _plt()
    groups: dict[str, list[dict]] = {}
    for p in points:
        key = ", ".join(f"{k}={p[k]}" for k in group_by) or "all"
        groups.setdefault(key, []).append(p)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, metric in zip(axes, ("p99_tpot_ms", "p99_ttft_ms")):
        for key, pts in groups.items():
            pts = sorted(pts, key=lambda p: p[vary])
            xs = [p[metric] for p in pts]
            ys = [p["output_throughput"] for p in pts]
            ax.plot(xs, ys, marker="o", label=key)
            for p, x, y in zip(pts, xs, ys):
                ax.annotate(str(p[vary]), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for k, limit in (slo or {}).items():
            if slo_field(k) == metric:
                ax.axvline(limit, color="r", ls="--", lw=1, label=f"SLO {k} = {limit:g} ms")
        if best is not None and best.get(metric) is not None:
            ax.scatter([best[metric]], [best["output_throughput"]], s=200, facecolors="none",
                       edgecolors="r", lw=2, zorder=3, label="best within SLO")
        ax.set_xlabel(f"{metric.replace('_ms', '')} (ms)")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"throughput vs latency, varying {vary}")
    _save(fig, path)
    return list(groups)


def plot_run(run: BenchRun, out_dir: str | Path, stem: str) -> dict[str, Path]:
    """The three single-run pictures into ``out_dir``: timeline, steps, kv."""
    out_dir = Path(out_dir)
    paths = {k: out_dir / f"{stem}-{k}.png" for k in ("timeline", "steps", "kv")}
    plot_timeline(run, paths["timeline"])
    plot_steps(run, paths["steps"])
    plot_kv(run, paths["kv"])
    return paths
