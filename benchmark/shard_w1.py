"""W1 straight into one shard over gRPC, scheduled by the router's own queue and batching loop: the shard-only
baseline of the end-to-end HTTP run (issue 3). See textgen_benchmark.baseline for what runs and what is timed.

The default budgets (textgen_benchmark.w1.workload_budgets) hold the whole workload, so all requests prefill
at once. The shard gets OMP_NUM_THREADS as the launcher's shard would: the value of this environment, else
torch's default for this machine.

Also printed: the run's projections' FLOP ceiling (textgen_benchmark.ceiling), the products its steps need at
the fastest rate each shape and row count reaches on this CPU, timed after the shard stops.

Usage: python benchmark/shard_w1.py [--model-dir DIR] [-n 64] [--seed 0] [--max-batch-prefill-tokens N]
       [--max-batch-total-tokens N] [--max-input-tokens N] [--max-total-tokens N] [--threads T] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from textgen_benchmark.baseline import default_threads, measure, summary
from textgen_benchmark.shard import DTYPES, small_model
from textgen_benchmark.w1 import Budgets, make_workload, workload_budgets


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="a built model (default: build/cached small Llama)")
    p.add_argument("-n", "--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="shard OMP threads (default: as the launcher's)")
    p.add_argument("--json", type=Path, help="also write the report as JSON here (with every request's end)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the shard's --dtype")
    Budgets.add_arguments(p)
    args = p.parse_args(argv)
    model_dir = args.model_dir or small_model()
    jobs = make_workload(str(model_dir), args.requests, args.seed, "burst", 0.0)
    budgets = workload_budgets(str(model_dir), jobs, args)
    report, ceiling = measure(model_dir, jobs, budgets, args.threads or default_threads(), args.dtype)
    print(summary(report), flush=True)
    print(f"projections' least times (fastest path, GFLOP/s):\n{ceiling.rates()}")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    unfinished = [o.id for o in report.outcomes if o.finish_reason is None]
    if unfinished:
        sys.exit(f"requests without an end: {unfinished}")


if __name__ == "__main__":
    main()
