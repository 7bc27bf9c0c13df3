"""Markdown tables printed at the end of a run: parameters, latency and throughput (TGI's layout)."""

from __future__ import annotations

from textgen_benchmark.stats import BatchResult, Latency, Throughput


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, each column padded to its widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def parameters_table(params: dict[str, str]) -> str:
    return markdown_table(["Parameter", "Value"], [[k, v] for k, v in params.items()])


def _ms(v: float) -> str:
    return f"{v:.2f} ms"


def _tps(v: float) -> str:
    return f"{v:.2f} tokens/secs"


def latency_table(results: list[BatchResult]) -> str:
    rows: list[list[str]] = []
    steps: list[tuple[str, str]] = [
        ("Prefill", "prefill"),
        ("Decode (token)", "decode_token"),
        ("Decode (total)", "decode_total"),
    ]
    for label, attr in steps:
        for r in results:
            lat: Latency = getattr(r, attr)
            rows.append(
                [
                    label,
                    str(r.batch_size),
                    _ms(lat.average),
                    _ms(lat.lowest),
                    _ms(lat.highest),
                    _ms(lat.p50),
                    _ms(lat.p90),
                    _ms(lat.p99),
                ]
            )
    return markdown_table(["Step", "Batch Size", "Average", "Lowest", "Highest", "p50", "p90", "p99"], rows)


def throughput_table(results: list[BatchResult]) -> str:
    rows: list[list[str]] = []
    for label, attr in (("Prefill", "prefill_throughput"), ("Decode", "decode_throughput")):
        for r in results:
            t: Throughput = getattr(r, attr)
            rows.append([label, str(r.batch_size), _tps(t.average), _tps(t.lowest), _tps(t.highest)])
    return markdown_table(["Step", "Batch Size", "Average", "Lowest", "Highest"], rows)


def report(params: dict[str, str], results: list[BatchResult]) -> str:
    return "\n\n".join([parameters_table(params), latency_table(results), throughput_table(results)]) + "\n"
