"""Latency and throughput statistics of one batch size's measured runs (TGI benchmark's definitions)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Latency:
    """Milliseconds over runs; percentile p is the sorted element at index floor(p/100 * n), as in TGI."""

    average: float
    lowest: float
    highest: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_ms: list[float]) -> Latency:
        if not values_ms:
            return cls(*(float("nan"),) * 6)
        s = sorted(values_ms)

        def pct(p: int) -> float:
            return s[min(len(s) - 1, int(p / 100 * len(s)))]

        return cls(sum(s) / len(s), s[0], s[-1], pct(50), pct(90), pct(99))


@dataclass(frozen=True)
class Throughput:
    """Tokens per second over runs."""

    average: float
    lowest: float
    highest: float

    @classmethod
    def of(cls, values: list[float]) -> Throughput:
        if not values:
            return cls(float("nan"), float("nan"), float("nan"))
        return cls(sum(values) / len(values), min(values), max(values))


@dataclass
class RunSamples:
    """Raw measurements of the runs of one batch size (seconds and tokens/s per run)."""

    batch_size: int
    prefill_s: list[float] = field(default_factory=list)
    prefill_tps: list[float] = field(default_factory=list)
    decode_token_s: list[float] = field(default_factory=list)
    decode_total_s: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class BatchResult:
    """What the tables, the JSON and the plot show for one batch size."""

    batch_size: int
    prefill: Latency
    decode_token: Latency
    decode_total: Latency
    prefill_throughput: Throughput
    decode_throughput: Throughput

    @classmethod
    def of(cls, samples: RunSamples) -> BatchResult:
        def ms(values: list[float]) -> list[float]:
            return [v * 1000.0 for v in values]

        return cls(
            batch_size=samples.batch_size,
            prefill=Latency.of(ms(samples.prefill_s)),
            decode_token=Latency.of(ms(samples.decode_token_s)),
            decode_total=Latency.of(ms(samples.decode_total_s)),
            prefill_throughput=Throughput.of(samples.prefill_tps),
            decode_throughput=Throughput.of(samples.decode_tps),
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready; a statistic with no samples (decode length 1 has no Decode calls) becomes null."""
        return {
            k: {n: None if math.isnan(x) else x for n, x in v.items()} if isinstance(v, dict) else v
            for k, v in asdict(self).items()
        }
