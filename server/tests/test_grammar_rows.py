"""Grammar-constrained rows (JSON schema, regex) on real shard processes, one rank and two tensor-parallel ranks.

The tiny llama has random weights, so only the constraint can make an output parse: every constrained output
must validate against its schema or full-match its regex, while free rows in the same batch keep generating
exactly what transformers does, through FilterBatch and a concatenation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from operator import methodcaller
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import torch
from shard_helpers import HFOracle, chooser, make_batch, make_request
from transformers import AutoTokenizer

from testing.shards import ShardHandle, ShardProcess
from textgen_pb import generate_pb2 as pb
from textgen_server.sampling.grammar import GrammarCompiler, RowGrammars

# Bounded schemas: every string, array and number has a limit, so an output closes well within MAX_NEW_TOKENS
# (a 6-character string is at most 6 * 6 bytes of \u escapes, each at least one token).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "color", "tags"],
    "additionalProperties": False,
}
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer", "minimum": 100, "maximum": 599}},
    "required": ["ok", "code"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[a-z]{2,4}"
MAX_NEW_TOKENS = 120
FREE_PROMPTS = {1: "def foo(x):", 3: "import os\nimport sys\n", 6: "x = 1"}


def json_params(schema: dict[str, Any], **overrides: object) -> pb.NextTokenChooserParameters:
    return chooser(grammar=json.dumps(schema), grammar_type=pb.GRAMMAR_TYPE_JSON, **overrides)


def regex_params(regex: str, **overrides: object) -> pb.NextTokenChooserParameters:
    return chooser(grammar=regex, grammar_type=pb.GRAMMAR_TYPE_REGEX, **overrides)


def constrained(request_id: int, params: pb.NextTokenChooserParameters, **kwargs: Any) -> pb.Request:
    """A constrained request that stops on EOS, as a grammar's end forces it to."""
    return make_request(request_id, "Answer:", MAX_NEW_TOKENS, ignore_eos=False, params=params, **kwargs)


class Ranks:
    """Every call goes to every rank at once, as the router's sharded client does; each rank reports its own rows,
    and the generations of all ranks are collected per request."""

    def __init__(self, handle: ShardHandle) -> None:
        self.stubs = [handle.stub(rank) for rank in range(len(handle.processes))]
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.top_tokens: dict[int, list[pb.Tokens]] = {}
        self.finished: dict[int, pb.GeneratedText] = {}

    def call(self, method: str, request: Any) -> Any:
        with ThreadPoolExecutor(len(self.stubs)) as pool:
            replies = list(pool.map(methodcaller(method, request, timeout=60), self.stubs))
        for reply in replies:
            for g in getattr(reply, "generations", []):
                self.tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
                self.logprobs.setdefault(g.request_id, []).extend(g.tokens.logprobs)
                self.top_tokens.setdefault(g.request_id, []).extend(g.top_tokens)
                if g.HasField("generated_text"):
                    self.finished[g.request_id] = g.generated_text
        return replies[0]

    def live(self, reply: Any) -> pb.CachedBatch | None:
        """The reply's batch without its finished requests (filtered as the router does), None when all ended."""
        if not reply.HasField("batch"):
            return None
        cached = reply.batch
        live = [i for i in cached.request_ids if i not in self.finished]
        if not live:
            self.call("ClearCache", pb.ClearCacheRequest(id=cached.id))
            return None
        if len(live) < len(cached.request_ids):
            return self.call("FilterBatch", pb.FilterBatchRequest(batch_id=cached.id, request_ids=live)).batch
        return cached

    def decode(self, batches: list[pb.CachedBatch]) -> pb.CachedBatch | None:
        return self.live(self.call("Decode", pb.DecodeRequest(batches=batches)))

    def prefill(self, batch: pb.Batch) -> pb.CachedBatch | None:
        return self.live(self.call("Prefill", pb.PrefillRequest(batch=batch)))


def run_mixed(handle: ShardHandle) -> Ranks:
    """Constrained and free rows: 4 prefilled together, one dropped by FilterBatch after 2 steps, 3 more joined by
    a concatenation, then decoded to the end."""
    ranks = Ranks(handle)
    first = [
        constrained(0, json_params(PERSON), top_n_tokens=2),
        make_request(1, FREE_PROMPTS[1], 12),
        constrained(2, regex_params(PHONE, do_sample=True, temperature=0.8, top_k=40, top_p=0.95, seed=7)),
        make_request(3, FREE_PROMPTS[3], 20),
        constrained(9, json_params(ANSWER)),  # dropped by the router below
    ]
    cached = ranks.prefill(make_batch(1, first))
    for _ in range(2):
        assert cached is not None
        cached = ranks.decode([cached])
    assert cached is not None
    kept = [i for i in cached.request_ids if i != 9]
    cached = ranks.call("FilterBatch", pb.FilterBatchRequest(batch_id=cached.id, request_ids=kept)).batch
    second = [
        constrained(4, json_params(ANSWER, do_sample=True, seed=3, repetition_penalty=1.3)),
        constrained(5, regex_params(r"abc[d]{40}"), stop=("d",)),
        make_request(6, FREE_PROMPTS[6], 10),
    ]
    new = ranks.prefill(make_batch(2, second))
    assert new is not None
    batch = ranks.decode([cached, new])
    while batch is not None:
        batch = ranks.decode([batch])
    return ranks


def check_mixed(ranks: Ranks, oracle: HFOracle) -> None:
    done = ranks.finished
    assert sorted(done) == [0, 1, 2, 3, 4, 5, 6]  # 9 was filtered out before it finished
    for request_id, schema in ((0, PERSON), (4, ANSWER)):
        jsonschema.validate(json.loads(done[request_id].text), schema)
        assert done[request_id].finish_reason == pb.FINISH_REASON_EOS_TOKEN
    assert re.fullmatch(PHONE, done[2].text), done[2].text
    assert done[2].finish_reason == pb.FINISH_REASON_EOS_TOKEN and done[2].seed == 7
    # A stop sequence still ends a constrained row: the first token holding a "d" ends the text with it.
    assert re.fullmatch(r"abcd+", done[5].text) and done[5].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    for request_id in (0, 2, 4, 5):
        # Logprobs come from the masked scores: the chosen token is always one the grammar allowed.
        assert all(lp > float("-inf") for lp in ranks.logprobs[request_id])
    # The paged engine's top-n tokens come from the masked scores the row chose from (TGI's FlashCausalLM): only
    # tokens the grammar allowed, fewer than 2 where it allowed one, the greedy choice first with its logprob.
    tops = ranks.top_tokens[0]
    assert len(tops) == done[0].generated_tokens and any(len(top.ids) >= 2 for top in tops)
    for top, token, logprob in zip(tops, ranks.tokens[0], ranks.logprobs[0], strict=True):
        assert 1 <= len(top.ids) <= 2 and all(lp > float("-inf") for lp in top.logprobs)
        assert (top.ids[0], top.logprobs[0]) == (token, logprob)
    for request_id, prompt in FREE_PROMPTS.items():
        assert ranks.tokens[request_id] == oracle.greedy(prompt, done[request_id].generated_tokens)
        assert done[request_id].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def one_shard(tiny_llama: Path) -> Iterator[ShardHandle]:
    with ShardProcess(tiny_llama) as handle:
        yield handle


def test_constrained_and_free_rows_through_filter_and_concatenate(
    one_shard: ShardHandle, llama_oracle: HFOracle
) -> None:
    check_mixed(run_mixed(one_shard), llama_oracle)


def test_two_tensor_parallel_shards_generate_what_one_does(
    tiny_llama: Path, one_shard: ShardHandle, llama_oracle: HFOracle
) -> None:
    with ShardProcess(tiny_llama, num_shard=2) as two_shards:
        two = run_mixed(two_shards)
    check_mixed(two, llama_oracle)
    assert two.tokens == run_mixed(one_shard).tokens  # seeded sampling under a grammar included


def test_an_unenforceable_grammar_refuses_its_row_only(one_shard: ShardHandle) -> None:
    bad = {
        2: regex_params("[a-"),
        3: chooser(grammar='{"type": "strin"}', grammar_type=pb.GRAMMAR_TYPE_JSON),
        4: chooser(grammar="not json", grammar_type=pb.GRAMMAR_TYPE_JSON),
        5: chooser(grammar="[0-9]+", grammar_type=pb.GRAMMAR_TYPE_NONE),
    }
    requests = [constrained(1, regex_params("yes|no")), *(constrained(i, p) for i, p in bad.items())]
    ranks = Ranks(one_shard)
    with pytest.raises(grpc.RpcError) as err:
        ranks.call("Prefill", pb.PrefillRequest(batch=make_batch(30, requests)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    lines = err.value.details().split("\n")
    assert [line.split(":")[0] for line in lines] == [f"request {i}" for i in bad]
    assert "unclosed character class" in lines[0]
    assert "Invalid type: strin" in lines[1]
    assert "`grammar` is not a JSON schema" in lines[2]
    assert "neither JSON nor REGEX" in lines[3]
    # The router prefills the valid row again alone: it runs under its grammar.
    cached = ranks.prefill(make_batch(30, requests[:1]))
    while cached is not None:
        cached = ranks.decode([cached])
    assert ranks.finished[1].text in ("yes", "no")


def test_columns_past_the_tokenizer_vocabulary_are_never_allowed(tiny_llama: Path) -> None:
    """A padded embedding gives logits wider than the tokenizer: a constrained row can never pick those ids."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    compiler = GrammarCompiler(tokenizer, {tokenizer.eos_token_id})
    grammars = RowGrammars.of([compiler.compile(regex_params("[0-9]+")), None], compiler, torch.device("cpu"))
    assert grammars is not None and grammars.rows is not None and grammars.rows.tolist() == [0]
    width = len(tokenizer) + 64
    masked = grammars.mask(torch.zeros(1, width))
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert allowed and all(i < len(tokenizer) for i in allowed)
    assert all(re.fullmatch("[0-9]+", tokenizer.decode([i])) for i in allowed)
    # Once the grammar can end, EOS is allowed; a filter to the free row leaves no grammar work at all.
    grammars.advance(torch.tensor([allowed[0]]))
    assert torch.isfinite(grammars.mask(torch.zeros(1, width))[0, tokenizer.eos_token_id])
    assert grammars.filter([1]) is None
