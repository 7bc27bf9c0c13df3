"""`textgen-benchmark`: latency and throughput of running shards, per batch size, over gRPC (TGI's benchmark).

Start the shards first (`textgen-launcher` or `textgen-server serve`), then e.g.
`textgen-benchmark -t models/small -b 1 -b 8 -b 32 --json results.json --plot results.png`.
Markdown tables go to stdout, progress to stderr. Exit status 1 with one line on stderr when the shards or the
tokenizer cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import TypeVar

import numpy as np
from tokenizers import Tokenizer

from textgen_benchmark.generation import Sampling, run_benchmark
from textgen_benchmark.stats import BatchResult
from textgen_benchmark.table import report
from textgen_common.cli_values import U32, USIZE, env_flag

T = TypeVar("T")
DEFAULT_BATCH_SIZES = [1, 2, 4, 8, 16, 32]


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(name, default)


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """TGI's flags; all but --batch-size also read from the environment (TOKENIZER_NAME, RUNS, ...)."""
    p = argparse.ArgumentParser(prog="textgen-benchmark", description=__doc__.splitlines()[0])
    tokenizer = _env("TOKENIZER_NAME", None)
    p.add_argument(
        "-t",
        "--tokenizer-name",
        default=tokenizer,
        required=tokenizer is None,
        help="hub id or local directory with tokenizer.json",
    )
    p.add_argument("--revision", default=_env("REVISION", "main"))
    p.add_argument(
        "-b",
        "--batch-size",
        type=_positive,
        action="append",
        help="batch size to sweep (repeatable; default 1,2,4,8,16,32)",
    )
    p.add_argument("-s", "--sequence-length", type=_positive, default=_env("SEQUENCE_LENGTH", "10"))
    p.add_argument("-d", "--decode-length", type=_positive, default=_env("DECODE_LENGTH", "8"))
    p.add_argument("-r", "--runs", type=_positive, default=_env("RUNS", "10"))
    p.add_argument("-w", "--warmups", type=USIZE, default=_env("WARMUPS", "1"))
    p.add_argument("-m", "--master-shard-uds-path", default=_env("MASTER_SHARD_UDS_PATH", "/tmp/textgen-server-0"))
    p.add_argument("--temperature", type=float, default=_env("TEMPERATURE", None))
    p.add_argument("--top-k", type=U32, default=_env("TOP_K", None))
    p.add_argument("--top-p", type=float, default=_env("TOP_P", None))
    p.add_argument("--typical-p", type=float, default=_env("TYPICAL_P", None))
    p.add_argument("--repetition-penalty", type=float, default=_env("REPETITION_PENALTY", None))
    p.add_argument("--frequency-penalty", type=float, default=_env("FREQUENCY_PENALTY", None))
    p.add_argument("--watermark", action="store_true", default=env_flag("WATERMARK"))
    p.add_argument("--do-sample", action="store_true", default=env_flag("DO_SAMPLE"))
    p.add_argument("--top-n-tokens", type=U32, default=_env("TOP_N_TOKENS", None))
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': to stdout, no tables)")
    p.add_argument("--plot", metavar="FILE.png", help="write throughput and latency against batch size")
    return p


def sampling_of(args: argparse.Namespace) -> Sampling:
    """Unset flags fall back to the neutral values (1.0 / 0 / 1.0 / 1.0 / 1.0 / 0.0)."""

    def given(value: T | None, default: T) -> T:
        return default if value is None else value

    return Sampling(
        temperature=given(args.temperature, 1.0),
        top_k=given(args.top_k, 0),
        top_p=given(args.top_p, 1.0),
        typical_p=given(args.typical_p, 1.0),
        repetition_penalty=given(args.repetition_penalty, 1.0),
        frequency_penalty=given(args.frequency_penalty, 0.0),
        watermark=args.watermark,
        do_sample=args.do_sample,
        top_n_tokens=given(args.top_n_tokens, 0),
    )


def load_tokenizer(name: str, revision: str) -> Tokenizer:
    """`name/tokenizer.json` for a local directory, else the hub's (cache first)."""
    local = Path(name) / "tokenizer.json"
    if local.is_file():
        return Tokenizer.from_file(str(local))
    from huggingface_hub import hf_hub_download

    return Tokenizer.from_file(hf_hub_download(name, "tokenizer.json", revision=revision))


def parameters(args: argparse.Namespace, sampling: Sampling) -> dict[str, object]:
    """The run's parameters, unset sampling options at the values the shard ran with (the JSON document)."""
    return {
        "Model": args.tokenizer_name,
        "Sequence Length": args.sequence_length,
        "Decode Length": args.decode_length,
        "Top N Tokens": sampling.top_n_tokens,
        "N Runs": args.runs,
        "Warmups": args.warmups,
        "Temperature": sampling.temperature,
        "Top K": sampling.top_k,
        "Top P": sampling.top_p,
        "Typical P": sampling.typical_p,
        "Repetition Penalty": sampling.repetition_penalty,
        "Frequency Penalty": sampling.frequency_penalty,
        "Watermark": sampling.watermark,
        "Do Sample": sampling.do_sample,
    }


# The parameters that are options in TGI's table, and the flag each comes from.
_OPTIONS = {
    "Top N Tokens": "top_n_tokens",
    "Temperature": "temperature",
    "Top K": "top_k",
    "Top P": "top_p",
    "Typical P": "typical_p",
    "Repetition Penalty": "repetition_penalty",
    "Frequency Penalty": "frequency_penalty",
}


def shown_parameters(args: argparse.Namespace, params: dict[str, object]) -> dict[str, str]:
    """`params` as TGI's parameters table prints them: an option as Rust's Debug writes it (`None`, `Some(0.5)`,
    `Some(5)`: what was given, not the value the shard ran with), a flag as `true` / `false`."""

    def shown(name: str, value: object) -> str:
        if name in _OPTIONS:
            given = getattr(args, _OPTIONS[name])
            if given is None:
                return "None"
            # A float flag is an f32 there: its shortest digits, with at least one decimal (`Some(1.0)`).
            if isinstance(given, float):
                given = np.format_float_positional(np.float32(given), unique=True, trim="0")
            return f"Some({given})"
        return str(value).lower() if isinstance(value, bool) else str(value)

    return {name: shown(name, value) for name, value in params.items()}


async def _run(args: argparse.Namespace, tokenizer: Tokenizer, sampling: Sampling) -> list[BatchResult]:
    from textgen_router.shard_client import ShardedClient

    client = await ShardedClient.connect(args.master_shard_uds_path)
    try:
        return await run_benchmark(
            client,
            tokenizer,
            args.batch_size or DEFAULT_BATCH_SIZES,
            args.sequence_length,
            args.decode_length,
            args.runs,
            args.warmups,
            sampling,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> None:
    from textgen_router.shard_client import ShardError

    args = build_parser().parse_args(argv)
    sampling = sampling_of(args)
    try:
        tokenizer = load_tokenizer(args.tokenizer_name, args.revision)
    except Exception as exc:  # noqa: BLE001 - any failure to find the tokenizer is one line for the user
        sys.exit(f"error: cannot load tokenizer {args.tokenizer_name}: {exc}")
    try:
        results = asyncio.run(_run(args, tokenizer, sampling))
    except ShardError as exc:
        sys.exit(f"error: shard at {args.master_shard_uds_path}: {exc.message}")
    params = parameters(args, sampling)
    document = {"parameters": params, "results": [r.to_dict() for r in results]}
    if args.json == "-":
        print(json.dumps(document, indent=2))
    else:
        print(report(shown_parameters(args, params), results), end="")
        if args.json:
            Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        from textgen_benchmark.plot import plot

        plot(results, args.plot, f"{args.tokenizer_name}: sequence {args.sequence_length}, decode {args.decode_length}")


if __name__ == "__main__":
    main()
