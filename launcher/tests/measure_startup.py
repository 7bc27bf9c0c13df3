"""Launch-to-healthy time of the real launcher (a measurement script, not a test).

    python launcher/tests/measure_startup.py MODEL_DIR [--port 3990] [--num-shard 1] [-- LAUNCHER FLAGS...]

Prints the seconds from spawning `textgen-launcher` to the first 200 on /health and the CPU seconds each
process (launcher, shards, router) used until then: on a busy machine the CPU seconds, not the wall time,
say what an idle machine would see. Stops the launcher with SIGTERM afterwards.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

HEALTH_TIMEOUT_S = 600.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, default=3990)
    parser.add_argument("--num-shard", type=int, default=1)
    args, extra = parser.parse_known_args()  # the rest (after `--`) goes to the launcher
    extra = [flag for flag in extra if flag != "--"]
    log = tempfile.NamedTemporaryFile("w", prefix="textgen-startup-", suffix=".log", delete=False)
    start = time.monotonic()
    launcher = subprocess.Popen(
        [
            "textgen-launcher",
            "--model-id",
            args.model_dir,
            "--num-shard",
            str(args.num_shard),
            "--hostname",
            "127.0.0.1",
            "--port",
            str(args.port),
            "--prometheus-port",
            str(args.port + 1),
            "--shard-uds-path",
            f"/tmp/textgen-startup-{args.port}",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        while time.monotonic() - start < HEALTH_TIMEOUT_S and launcher.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            print(f"not healthy (log: {log.name})", file=sys.stderr)
            return 1
        wall = time.monotonic() - start
        root = psutil.Process(launcher.pid)
        for proc in [root, *root.children(recursive=True)]:
            times = proc.cpu_times()
            name = next((Path(part).name for part in proc.cmdline() if "textgen-" in part), proc.name())
            print(f"{name:20s} (pid {proc.pid}) {times.user + times.system:6.1f} s CPU")
        print(f"launch to healthy: {wall:.1f} s (load average {psutil.getloadavg()[0]:.1f}; log: {log.name})")
        return 0
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(120)


if __name__ == "__main__":
    sys.exit(main())
