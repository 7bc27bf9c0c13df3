"""W1, the end-to-end workload: a fixed, seeded request mix and the token budgets it runs under.

W1 = n requests (64 by default), prompts of 32-256 tokens, 64-128 new tokens, sent all at once (burst) or at a
Poisson rate. benchmark/http_load.py sends it over HTTP; the shard-only baseline (textgen_benchmark.baseline)
sends the same requests straight into one shard.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any


@dataclass
class Job:
    prompt: str
    max_new_tokens: int
    send_at: float


def make_workload(tokenizer_dir: str, n: int, seed: int, arrival: str, rate: float) -> list[Job]:
    """Seeded prompts of 32-256 tokens (decoded from random vocabulary ids), 64-128 new tokens each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for _ in range(n):
        text = random_text(tok, rng, rng.randint(32, 256))
        if arrival == "poisson":
            t += rng.expovariate(rate)
        jobs.append(Job(text, rng.randint(64, 128), t))
    return jobs


def random_text(tok: Any, rng: random.Random, length: int) -> str:
    """Text of about `length` tokens of `tok` (a transformers tokenizer), decoded from random non-special ids."""
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    text = tok.decode([rng.choice(ids) for _ in range(length)])
    # Re-encode and cut so the text really has about `length` tokens after tokenization.
    text = tok.decode(tok(text, add_special_tokens=False)["input_ids"][:length])
    assert isinstance(text, str)  # one flat list of ids decodes to one string
    return text


def request_body(route: str, job: Job, model: str) -> tuple[str, dict]:
    """The route's path and body for `job`: `generate`, `chat`, or `chat_json` (chat with OpenAI's
    `response_format: {"type": "json_object"}`, so every row of every step is grammar-constrained)."""
    if route == "generate":
        return "/generate_stream", {"inputs": job.prompt, "parameters": {"max_new_tokens": job.max_new_tokens}}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": job.prompt}],
        "max_tokens": job.max_new_tokens,
        "temperature": 0,
        "stream": True,
    }
    if route == "chat_json":
        body["response_format"] = {"type": "json_object"}
    return "/v1/chat/completions", body


@dataclass(frozen=True)
class Budgets:
    """The launcher's token limits for a run; the shard-only baseline schedules under the same."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        for name in ("max-input-tokens", "max-total-tokens", "max-batch-prefill-tokens", "max-batch-total-tokens"):
            p.add_argument(f"--{name}", type=int, help="launcher flag (default: what lets every request batch at once)")

    def launcher_args(self) -> list[str]:
        return [arg for name, value in vars(self).items() for arg in (f"--{name.replace('_', '-')}", str(value))]


def workload_budgets(tokenizer_dir: str, jobs: list[Job], args: argparse.Namespace) -> Budgets:
    """Budgets from `args`, each unset one sized so the whole workload fits one padded prefill.

    The small model's launcher defaults (prefill 2048, batch total 16000) hold only ~7 W1 prompts per prefill,
    so the router would batch far fewer requests than the shard-only run: like for like needs both to allow
    n * longest prompt tokens of prefill (the padded rule) plus every max_new_tokens.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    # As the router counts: /generate with special tokens, the chat route its templated prompt without.
    chats = tok.apply_chat_template(
        [[{"role": "user", "content": j.prompt}] for j in jobs], add_generation_prompt=True, tokenize=False
    )
    longest = max(
        max(len(tok(j.prompt)["input_ids"]) for j in jobs),
        max(len(tok(c, add_special_tokens=False)["input_ids"]) for c in chats),
    )
    max_input = args.max_input_tokens or longest
    prefill = args.max_batch_prefill_tokens or len(jobs) * max_input
    return Budgets(
        max_input_tokens=max_input,
        max_total_tokens=args.max_total_tokens or max_input + max(j.max_new_tokens for j in jobs),
        max_batch_prefill_tokens=prefill,
        max_batch_total_tokens=args.max_batch_total_tokens or prefill + sum(j.max_new_tokens for j in jobs),
    )
