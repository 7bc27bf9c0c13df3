"""Request builders and the transformers oracle shared by the shard tests (imported, not fixtures)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from operator import methodcaller
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from textgen_pb import generate_pb2 as pb

if TYPE_CHECKING:
    from testing.shards import ShardHandle
    from textgen_server.layers.tensor_parallel import Linear
    from textgen_server.models.model import Batch, Model
    from textgen_server.models.paged_lm import PagedCausalLM


def chooser(**overrides: object) -> pb.NextTokenChooserParameters:
    """TGI's defaults (what the router sends for a plain greedy request), with overrides."""
    params = dict(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        typical_p=1.0,
        do_sample=False,
        seed=0,
        repetition_penalty=1.0,
        frequency_penalty=0.0,
    )
    params.update(overrides)
    return pb.NextTokenChooserParameters(**params)  # type: ignore[arg-type]


def make_request(
    request_id: int,
    text: str,
    max_new_tokens: int = 8,
    *,
    ignore_eos: bool = True,
    stop: tuple[str, ...] = (),
    prefill_logprobs: bool = False,
    top_n_tokens: int = 0,
    truncate: int = 0,
    params: pb.NextTokenChooserParameters | None = None,
) -> pb.Request:
    """A request the way the router builds it: text in one input chunk and mirrored in `inputs`."""
    return pb.Request(
        id=request_id,
        inputs=text,
        input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]),
        truncate=truncate,
        add_special_tokens=True,
        parameters=params or chooser(),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new_tokens, stop_sequences=list(stop), ignore_eos_token=ignore_eos
        ),
        prefill_logprobs=prefill_logprobs,
        top_n_tokens=top_n_tokens,
    )


def make_batch(batch_id: int, requests: list[pb.Request]) -> pb.Batch:
    return pb.Batch(
        id=batch_id,
        requests=requests,
        size=len(requests),
        max_tokens=sum(64 + r.stopping_parameters.max_new_tokens for r in requests),
    )


def generate_over_grpc(stub: Any, batch: pb.Batch) -> dict[int, list[int]]:
    """Prefill `batch` on a shard's stub and decode it to the end: each request's tokens."""
    tokens: dict[int, list[int]] = {r.id: [] for r in batch.requests}
    response = stub.Prefill(pb.PrefillRequest(batch=batch), timeout=60)
    while True:
        for generation in response.generations:
            tokens[generation.request_id].extend(generation.tokens.ids)
        if not response.HasField("batch"):
            return tokens
        response = stub.Decode(pb.DecodeRequest(batches=[response.batch]), timeout=60)


class HFOracle:
    """transformers itself, in this process, on the same model directory: the correctness reference."""

    def __init__(self, model_dir: Path, dtype: str = "float32", attention: str = "sdpa") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention).eval()

    def greedy(self, text: str, max_new_tokens: int) -> list[int]:
        import torch

        ids = self.tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            out = self.model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, ids.input_ids.shape[1] :].tolist()

    def logits(self, text: str):  # -> torch.Tensor [seq, vocab], float32
        import torch

        ids = self.tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            return self.model(**ids).logits[0].float()

    def log_softmax(self, text: str):  # -> torch.Tensor [seq, vocab]
        import torch

        return torch.log_softmax(self.logits(text), -1)


def record(tokens: dict[int, list[int]], generations: list[pb.Generation]) -> None:
    """Append each generation's token ids to its request's list."""
    for g in generations:
        tokens.setdefault(g.request_id, []).extend(g.tokens.ids)


def generate_all(model: Model, batch: Batch | None) -> dict[int, list[int]]:
    """Run to the end, filtering finished requests out (and dropping an empty batch) as the router would."""
    tokens: dict[int, list[int]] = {}
    while batch is not None:
        generations, batch, _ = model.generate_token(batch)
        record(tokens, generations)
        done = {g.request_id for g in generations if g.HasField("generated_text")}
        if batch is not None and done:
            live = [r.id for r in batch.requests if r.id not in done]  # type: ignore[attr-defined]
            if not live:
                batch.release()
            batch = batch.filter(live) if live else None
    return tokens


def check_uneven_batch(model: Model, oracle: HFOracle) -> None:
    """Ten rows (enough for grouped decode attention), prompts of 1-30 words, uneven lengths to generate; a
    second batch of three joins after two steps, so the batch is filtered and concatenated. Greedy tokens must
    be transformers'."""
    endings = ["def foo(x):", "class", "for i in range(10):\n    print(i)", "x = 1"]
    prompts = [" ".join(["word"] * (1 + 3 * i)) + endings[i % 4] for i in range(13)]
    new_tokens = [3 + i % 5 for i in range(10)] + [4, 12, 9]
    requests = [make_request(i, p, n) for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))]
    batch: Batch | None = model.batch_type.from_pb(make_batch(1, requests[:10]), model)
    tokens: dict[int, list[int]] = {}
    for _ in range(2):
        assert batch is not None
        generations, batch, _ = model.generate_token(batch)
        record(tokens, generations)
    generations, joiners, _ = model.generate_token(model.batch_type.from_pb(make_batch(2, requests[10:]), model))
    record(tokens, generations)
    assert batch is not None and joiners is not None
    for request_id, ids in generate_all(model, model.batch_type.concatenate([batch, joiners])).items():
        tokens[request_id].extend(ids)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == oracle.greedy(prompt, new_tokens[i]), f"request {i}"


# Rows whose processed scores differ from their logits (a warper; both penalties on a repetitive prompt, so the
# best tokens are penalised) and one whose do not; a batch of the greedy rows alone takes the greedy op's path.
TOP_N_ROWS = {
    1: ("def foo(x):", chooser(temperature=0.5, seed=3)),
    2: ("x = 1\nx = 1\nx = 1\nx =", chooser(repetition_penalty=3.0, frequency_penalty=2.0)),
    3: ("class", chooser()),
}


def check_decode_paths(model: PagedCausalLM, rows: int) -> None:
    """Each decode step's logits through the C++ decode blocks, through `DecoderLayer.decode` and through the
    modules' `forward`, on the same inputs, are the same bits (writing a step's keys and values again writes the
    same values); `rows` prompts of different lengths."""
    from textgen_server.layers.linear_choice import bucket
    from textgen_server.models.paged_batch import PagedBatch

    module = model.module
    assert module.decodes_straight and module.decodes_in_blocks
    prompts = ["def foo(x):", "class A:\n    pass\n" * 3, "x"][:rows]
    batch = PagedBatch.from_pb(make_batch(7, [make_request(i, p, 6) for i, p in enumerate(prompts)]), model)
    _, next_batch, _ = model.generate_token(batch)  # the prefill
    steps = 0
    while next_batch is not None:
        input_ids, positions, step = model._step(next_batch)
        logits = []
        for straight, blocks in ((True, True), (True, False), (False, False)):
            module.decodes_straight, module.decodes_in_blocks = straight, blocks
            try:
                logits.append(module.forward_paged(input_ids, positions, step, None, None))
            finally:
                module.decodes_straight = module.decodes_in_blocks = True
        assert torch.equal(logits[0], logits[1]) and torch.equal(logits[1], logits[2])
        _, next_batch, _ = model.generate_token(next_batch)
        steps += 1
    assert steps == 5
    assert module._layer_blocks[bucket(rows)] is not None  # the steps went through the blocks


def check_top_n_distribution(model: Model, oracle: HFOracle, *, processed: bool) -> None:
    """Prefill TOP_N_ROWS with top_n_tokens=3, all together and the greedy ones alone. Each token's logprob is
    its entry of log_softmax(processed scores of transformers' logits); the top-n tokens are the best 3 of that
    same distribution when `processed` (TGI's FlashCausalLM), of log_softmax(logits) otherwise (its CausalLM)."""
    import pytest
    import torch

    from textgen_server.sampling.chooser import HeterogeneousNextTokenChooser

    for batch_id, rows in enumerate(([1, 2, 3], [2, 3]), start=1):
        requests = [make_request(i, TOP_N_ROWS[i][0], 2, top_n_tokens=3, params=TOP_N_ROWS[i][1]) for i in rows]
        generations, batch, _ = model.generate_token(model.batch_type.from_pb(make_batch(batch_id, requests), model))
        assert batch is not None
        batch.release()
        assert sorted(g.request_id for g in generations) == rows
        for generation in generations:
            text, params = TOP_N_ROWS[generation.request_id]
            logits = oracle.logits(text)[-1:]
            prompt = oracle.tokenizer(text)["input_ids"]
            reference = HeterogeneousNextTokenChooser.from_pb([params], [prompt], logits.shape[-1], logits.device)
            chosen_from = torch.log_softmax(reference.process(torch.tensor(prompt[-1:]), logits), -1)[0]
            token, logprob = generation.tokens.ids[0], generation.tokens.logprobs[0]
            assert logprob == pytest.approx(float(chosen_from[token]), abs=1e-4)
            expected = (chosen_from if processed else torch.log_softmax(logits, -1)[0]).topk(3)
            (top,) = generation.top_tokens
            assert list(top.ids) == expected.indices.tolist(), generation.request_id
            assert list(top.logprobs) == pytest.approx(expected.values.tolist(), abs=1e-4), generation.request_id
            if processed and token in top.ids:  # one distribution: the same number in both lists
                assert top.logprobs[list(top.ids).index(token)] == pytest.approx(logprob, abs=1e-6)


def generate_on_ranks(
    handle: ShardHandle,
    batch_requests: list[pb.Request],
) -> tuple[dict[int, list[int]], list[set[int]]]:
    """Prefill then decode to the end on every rank of `handle` at once, as the router's ShardedClient does.

    Returns each request's tokens and, per rank, which request ids that rank reported.
    """
    ranks = range(len(handle.processes))
    stubs = [handle.stub(rank) for rank in ranks]
    tokens: dict[int, list[int]] = {r.id: [] for r in batch_requests}
    reported: list[set[int]] = [set() for _ in ranks]
    batch = make_batch(0, batch_requests)
    with ThreadPoolExecutor(len(stubs)) as pool:
        replies = list(pool.map(methodcaller("Prefill", pb.PrefillRequest(batch=batch), timeout=60), stubs))
        while True:
            for rank, reply in enumerate(replies):
                for g in reply.generations:
                    tokens[g.request_id].extend(g.tokens.ids)
                    reported[rank].add(g.request_id)
            if not replies[-1].HasField("batch"):
                return tokens, reported
            decode = pb.DecodeRequest(batches=[replies[-1].batch])
            replies = list(pool.map(methodcaller("Decode", decode, timeout=60), stubs))


def quantized_logits(
    model_dir: Path, dtype: torch.dtype, prompt: list[int], requested: str | None = None
) -> tuple[torch.Tensor, list[Linear]]:
    """The float32 logits of `prompt` from the tensor-parallel model of a (quantized) checkpoint loaded in this
    process on one rank, and its projections (`requested`: --quantize, else what the checkpoint says)."""
    from transformers import AutoConfig

    from textgen_server.layers.quantization import read_quant_config
    from textgen_server.layers.tensor_parallel import Linear
    from textgen_server.models.tp_llama import load_tp_model
    from textgen_server.utils.dist import DistInfo

    quant = read_quant_config(model_dir, json.loads((model_dir / "config.json").read_text()), requested)
    config = AutoConfig.from_pretrained(model_dir)
    model = load_tp_model(model_dir, config, dtype, torch.device("cpu"), DistInfo(0, 1, None), quant)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model(ids, torch.ones_like(ids), torch.arange(len(prompt))[None], model.new_cache())
    return out.logits[0].float(), [m for m in model.modules() if isinstance(m, Linear)]
