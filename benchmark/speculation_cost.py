"""What a refused n-gram guess costs: a paged decode step whose rows each feed N guesses that are all refused,
against the same step without guesses, in one process on the small Llama.

Each timed step is a real `PagedCausalLM.generate_token` over a batch of B rows: the rows' guesses are set
before the step to a token the model never chooses (the BOS id), so the forward computes 1 + N tokens per row
and every row still emits one. The two kinds of step alternate on two batches of the same requests; the
figure is the median ms per step and the ratio. `shard_decode.py --speculate N [--cycling]` gives the other
side: tokens/s when guesses are confirmed, through a real shard.

    python benchmark/speculation_cost.py [--guesses 3] [--batch 1 --batch 8 --batch 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from textgen_benchmark.generation import Sampling, make_batch, prompt_of_length
from textgen_benchmark.shard import DTYPES, small_model
from textgen_benchmark.timing import alternate
from textgen_pb import generate_pb2
from textgen_server.config import ServeConfig
from textgen_server.loader import get_model
from textgen_server.models.paged_batch import PagedBatch
from textgen_server.models.paged_lm import PagedCausalLM

PROMPT_LEN = 32
STEPS = 24  # timed steps of each kind; every request may emit one token per step


class Steps:
    """Decode steps of one batch of `pb`'s requests, each row feeding `guesses` copies of `refused` first."""

    def __init__(self, model: PagedCausalLM, pb: generate_pb2.Batch, guesses: int, refused: int) -> None:
        self.model, self.guesses, self.refused = model, guesses, refused
        _, batch, _ = model.generate_token(PagedBatch.from_pb(pb, model))  # the prefill
        assert batch is not None
        self.batch = batch

    def step(self) -> None:
        rows = len(self.batch)
        self.batch.speculative_ids = [[self.refused] * self.guesses for _ in range(rows)]
        self.batch.chunk_lengths = [1 + self.guesses] * rows
        _, batch, _ = self.model.generate_token(self.batch)
        assert batch is not None, "a request ended: give make_batch more new tokens"
        self.batch = batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guesses", type=int, default=3)
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1, 8, 32)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, help="a built model (default: build/cached small Llama)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or small_model()
    model = get_model(ServeConfig(str(model_dir), dtype=args.dtype, speculate=args.guesses))
    assert isinstance(model, PagedCausalLM)
    from tokenizers import Tokenizer

    prompt = prompt_of_length(Tokenizer.from_file(str(model_dir / "tokenizer.json")), PROMPT_LEN)
    refused = getattr(model.module.config, "bos_token_id", None) or 0  # BOS: never the model's next token here
    print(f"model {model_dir}, {args.dtype}, {args.threads} threads, {args.guesses} refused guesses per row")
    print("| batch | no guesses ms/step | refused guesses ms/step | ratio |")
    print("|------:|-------------------:|------------------------:|------:|")
    for size in args.batch or [1, 8, 32]:
        pb = make_batch(prompt, size, PROMPT_LEN, 2 * STEPS + 2, Sampling())
        plain, guessing = Steps(model, pb, 0, refused), Steps(model, pb, args.guesses, refused)
        plain_s, guessing_s = alternate([plain.step, guessing.step], STEPS)
        plain.batch.release()
        guessing.batch.release()
        print(f"| {size} | {plain_s * 1e3:.1f} | {guessing_s * 1e3:.1f} | {guessing_s / plain_s:.2f} |")


if __name__ == "__main__":
    main()
