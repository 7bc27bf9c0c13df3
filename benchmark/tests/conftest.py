"""The benchmark scripts run in the test process, as `python benchmark/NAME.py ARGS` runs them, with their shards
forked from the test process's preloader (testing/preload.py): the scripts' imports are already done, and each
shard start costs its model load, not its 5-7 s of imports. What the scripts measure is not checked here, only
that they run and print their figures."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from testing import preload
from textgen_benchmark import shard

BENCHMARK = Path(__file__).resolve().parent.parent


@pytest.fixture
def run_script(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """`run_script(NAME, *ARGS)`: benchmark/NAME.py's `main(ARGS)` in this process; returns what it printed (a
    `SystemExit` or any other error propagates)."""
    monkeypatch.setattr(shard, "start_process", preload.start_process)

    def run(name: str, *args: str) -> str:
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARK / f"{name}.py")
        assert spec is not None and spec.loader is not None
        script = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, script)  # where dataclasses look a script's classes up
        spec.loader.exec_module(script)
        capsys.readouterr()
        script.main(list(args))
        return capsys.readouterr().out

    return run
