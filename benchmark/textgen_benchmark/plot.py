"""PNG of decode/prefill throughput and latency against batch size (the TUI's charts, as a file)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on benchmark machines

import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen before pyplot loads

from textgen_benchmark.stats import BatchResult  # noqa: E402


def plot(results: list[BatchResult], path: str | Path, title: str) -> Path:
    """Two panels: throughput (tokens/s) and average latency (ms) per batch size, prefill and decode."""
    sizes = [r.batch_size for r in results]
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax_tp.plot(sizes, [r.prefill_throughput.average for r in results], "o-", label="prefill")
    ax_tp.plot(sizes, [r.decode_throughput.average for r in results], "s-", label="decode")
    ax_tp.set(xlabel="batch size", ylabel="tokens/s", title="Throughput")
    ax_lat.plot(sizes, [r.prefill.average for r in results], "o-", label="prefill")
    ax_lat.plot(sizes, [r.decode_token.average for r in results], "s-", label="decode (token)")
    ax_lat.set(xlabel="batch size", ylabel="ms", title="Latency (average)")
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
