"""Memory of the shard's CPU linear layouts: a real shard's resident set per TEXTGEN_CPU_LINEAR value.

For each dtype and each value (auto, linear, mkl, onednn) one `textgen-server serve` process starts on the
small Llama; once it answers Health its RSS is read, and its start-up log gives what `auto` chose (one line per
projection shape). A forced path keeps one layout of every weight; `auto` keeps one more for each shape where
some bucket of rows chose another path than the rest.

    python benchmark/linear_memory.py [--dtype float32 bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import psutil

from textgen_benchmark.shard import DTYPES, small_model, start_shard, stop
from textgen_server.layers.linear_choice import CHOICES, ENV


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model_dir = small_model()
    uds = f"/tmp/textgen-bench-{os.getpid()}"
    log = Path(tempfile.gettempdir()) / "textgen-bench-shard.log"  # where start_shard writes the shard's log
    print("| dtype | TEXTGEN_CPU_LINEAR | shard RSS MiB |")
    print("|---|---|---:|")
    choices: list[str] = []
    for dtype in args.dtype:
        for value in CHOICES:
            proc = start_shard(model_dir, uds, args.threads, dtype=dtype, extra_env={ENV: value})
            try:
                rss = psutil.Process(proc.pid).memory_info().rss
            finally:
                stop(proc)
            print(f"| {dtype} | {value} | {rss / 2**20:.0f} |", flush=True)
            if value == "auto":
                choices += [line for line in log.read_text().splitlines() if "CPU linear" in line]
    print("\nauto's choices:\n" + "\n".join(choices))


if __name__ == "__main__":
    main()
