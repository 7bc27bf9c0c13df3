"""Continuous batching must not change anything: 32 concurrent distinct requests each equal their solo run."""

from __future__ import annotations

import asyncio

from textgen_client import AsyncClient
from textgen_client.types import Response

WORDS = ["import", "def", "class", "return", "while", "lambda", "yield", "assert"]
# Distinct prompts of different lengths and budgets, so requests join and leave the batch at different steps.
REQUESTS = [(" ".join(WORDS[: 1 + i % 8]) + f" x{i}", 3 + i % 6) for i in range(32)]


async def _run_all(llama_client: AsyncClient, concurrent: bool) -> list[Response]:
    calls = (llama_client.generate(prompt, max_new_tokens=n, decoder_input_details=True) for prompt, n in REQUESTS)
    if concurrent:
        return list(await asyncio.gather(*calls))
    return [await call for call in calls]


def test_load_equals_solo(llama_async_client: AsyncClient) -> None:
    solo = asyncio.run(_run_all(llama_async_client, concurrent=False))
    together = asyncio.run(_run_all(llama_async_client, concurrent=True))
    assert len({r.generated_text for r in solo}) > 1  # distinct requests really produce distinct outputs
    for (prompt, _), alone, batched in zip(REQUESTS, solo, together, strict=True):
        assert batched.details is not None and alone.details is not None
        assert [t.id for t in batched.details.tokens] == [t.id for t in alone.details.tokens], prompt
        assert batched.generated_text == alone.generated_text, prompt
        assert batched.details.finish_reason == alone.details.finish_reason
        for a, b in zip(alone.details.tokens, batched.details.tokens, strict=True):
            # Padding and batch shape move logprobs only in the last float bits.
            assert abs((a.logprob or 0.0) - (b.logprob or 0.0)) < 1e-3
