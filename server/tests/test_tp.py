"""Tensor parallelism in-process: the TP model against transformers, and the layers at world size 2 (gloo).

Oracle: greedy tokens of a left-padded batch, decoded step by step through a DynamicCache exactly as the
padded CausalLM drives the model, equal `AutoModelForCausalLM.generate` on each unpadded prompt.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig, MistralConfig, PreTrainedModel

from textgen_common.ports import free_port
from textgen_server.layers.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from textgen_server.models.cache_names import cache_keyword
from textgen_server.models.tp_llama import load_tp_model
from textgen_server.utils.dist import DistInfo, initialize_torch_distributed
from textgen_server.utils.weights import Weights

CPU = torch.device("cpu")
ONE = DistInfo(rank=0, world_size=1, group=None)
STEPS = 8
PROMPTS = [[5, 17, 250, 33, 9, 120, 64, 7, 300, 41, 12], [88, 3, 19, 200]]


def padded_greedy(
    model: torch.nn.Module,
    prompts: list[list[int]],
    steps: int,
    own_cache: bool = False,
) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens per row and the prefill logits, driving the model like the padded CausalLM does; with
    `own_cache` the model makes its own cache (the TP model's PaddedKVCache), else a transformers DynamicCache."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    keyword = cache_keyword(model)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        **{keyword: None if own_cache else DynamicCache()},
    )
    prefill_logits = out.logits
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for row, token in zip(tokens, nxt[:, 0].tolist(), strict=True):
            row.append(token)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        position_ids = position_ids[:, -1:] + 1
        out = model(
            input_ids=nxt,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            **{keyword: getattr(out, keyword)},
        )
    return tokens, prefill_logits


def reference(
    model_dir: Path, steps: int = STEPS, dtype: torch.dtype = torch.float32, attention: str = "sdpa"
) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy `generate` per unpadded prompt, and its prefill logits on the padded batch."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention).eval()
    greedy = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=steps,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            greedy.append(out[0, len(prompt) :].tolist())
        _, logits = padded_greedy(hf, PROMPTS, 0)
    return greedy, logits


def real_positions() -> torch.Tensor:
    width = max(map(len, PROMPTS))
    return torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in PROMPTS])


def check_against_reference(
    model_dir: Path,
    dist: DistInfo,
    ref: tuple[list[list[int]], torch.Tensor],
    dtype: torch.dtype = torch.float32,
    steps: int = STEPS,
    own_cache: bool = False,
) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    model = load_tp_model(model_dir, config, dtype, CPU, dist)
    tokens, logits = padded_greedy(model, PROMPTS, steps, own_cache)
    keep = real_positions()
    tolerance = {} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}  # bf16: torch's own defaults
    torch.testing.assert_close(logits[keep], ref[1][keep], **tolerance)
    assert tokens == ref[0]


def random_model_dir(root: Path, config: LlamaConfig | MistralConfig) -> Path:
    """A saved random model with wide weights (clear greedy winners) for config variants the builder lacks."""
    torch.manual_seed(0)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(root)
    return root


DIMS = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
VARIANTS = {
    # Tied head, biases on every attention projection, llama3 rope scaling.
    "llama3-tied-bias": LlamaConfig(
        **DIMS,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
    # Sequences (11 + 8 tokens) outgrow max_position_embeddings, so the dynamic frequencies get recomputed.
    "llama-dynamic-rope": LlamaConfig(
        **DIMS,
        max_position_embeddings=12,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ),
    # A window shorter than the prompt, and head_dim != hidden / heads.
    "mistral-window": MistralConfig(**DIMS, max_position_embeddings=64, sliding_window=5, head_dim=24),
}


@pytest.fixture(scope="module")
def built(tiny_llama: Path, tiny_mistral: Path, tiny_qwen2: Path) -> dict[str, Path]:
    """The builder's tiny llama, mistral and qwen2 (trained tokenizer, random weights), from the session cache."""
    return {"llama": tiny_llama, "mistral": tiny_mistral, "qwen2": tiny_qwen2}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_one_shard_matches_transformers(arch: str, built: dict[str, Path]) -> None:
    check_against_reference(built[arch], ONE, reference(built[arch]))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_bfloat16_matches_transformers_eager(arch: str, built: dict[str, Path]) -> None:
    # On a CPU the bf16 model attends with two bf16 matmuls and an fp32 softmax, as transformers' eager
    # attention does: the same logits, and the same greedy tokens over a longer run.
    check_against_reference(built[arch], ONE, reference(built[arch], 16, torch.bfloat16, "eager"), torch.bfloat16, 16)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(variant: str, tmp_path: Path) -> None:
    model_dir = random_model_dir(tmp_path, VARIANTS[variant])
    check_against_reference(model_dir, ONE, reference(model_dir))


@pytest.mark.parametrize("decode_kernel", ["1", "0"])
@pytest.mark.parametrize("variant", ["llama-dynamic-rope", "llama3-tied-bias"])
def test_bfloat16_variants_with_their_own_cache_match_transformers_eager(
    variant: str, decode_kernel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The padded cache's decode steps (GQA among the variants): the bf16 decode attention op or, switched off,
    # the matmul over whole buffers. Not mistral-window: in bf16 its left-padded row already parts from
    # transformers' eager tokens at the prefill, with either decode path and with a DynamicCache alike.
    monkeypatch.setenv("TEXTGEN_CPU_DECODE_KERNEL", decode_kernel)
    model_dir = random_model_dir(tmp_path, VARIANTS[variant])
    check_against_reference(
        model_dir, ONE, reference(model_dir, 16, torch.bfloat16, "eager"), torch.bfloat16, 16, own_cache=True
    )


def test_unsupported_architecture_and_indivisible_sizes_are_clear_errors(tiny_gpt2: Path, tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="model type 'gpt2' has no tensor-parallel implementation"):
        load_tp_model(tiny_gpt2, AutoConfig.from_pretrained(tiny_gpt2), torch.float32, CPU, ONE)
    # Validation happens before any collective, so a 3-rank DistInfo without a group is enough here.
    three = DistInfo(rank=0, world_size=3, group=None)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by the number of shards \(3\)"):
        load_tp_model(tiny_llama, AutoConfig.from_pretrained(tiny_llama), torch.float32, CPU, three)


# ---------------------------------------------------------------- world size 2 (spawned ranks, gloo) -----


def _layers_against_full(dist: DistInfo, layer_dir: Path) -> None:
    """Column -> row, vocab-parallel embedding (uneven vocab) and LM head (even and uneven) vs unsharded."""
    full = Weights.from_dir(layer_dir, CPU, torch.float32)
    mine = Weights.from_dir(layer_dir, CPU, torch.float32, dist.rank, dist.world_size)
    x = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(1))
    col = ColumnParallelLinear.load_multi(mine, ["col"], bias=True)
    row = RowParallelLinear.load(mine, "row", bias=True, dist=dist)
    assert (col.out_features, col.in_features, row.out_features, row.in_features) == (4, 6, 6, 4)
    expected = F.linear(
        F.linear(x, full.get_tensor("col.weight"), full.get_tensor("col.bias")),
        full.get_tensor("row.weight"),
        full.get_tensor("row.bias"),
    )
    torch.testing.assert_close(row(col(x)), expected)

    ids = torch.tensor([[0, 5, 6, 10], [3, 9, 1, 8]])
    emb = VocabParallelEmbedding.load(mine, "emb.weight", dist)
    assert emb.weight.shape[0] == (6 if dist.rank == 0 else 5)
    torch.testing.assert_close(emb(ids), F.embedding(ids, full.get_tensor("emb.weight")))
    # Mapped rows stay float32 as stored; a bfloat16 lookup gives the bits of a table converted at load.
    mine_bf16 = Weights.from_dir(layer_dir, CPU, torch.bfloat16, dist.rank, dist.world_size)
    mapped = VocabParallelEmbedding.load(mine_bf16, "emb.weight", dist, mapped=True)
    assert mapped.weight.dtype == torch.float32 and mapped.weight.shape == emb.weight.shape
    assert torch.equal(mapped(ids), F.embedding(ids, full.get_tensor("emb.weight").bfloat16()))

    for name, gathered in (("emb.weight", False), ("head.weight", True)):
        head = ParallelLMHead.load(mine, name, dist)
        assert head.gather is gathered
        torch.testing.assert_close(head(x), F.linear(x, full.get_tensor(name)))


def _rank_main(rank: int, world_size: int, port: int, layer_dir: Path, refs: dict[str, Path]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist = initialize_torch_distributed()
    _layers_against_full(dist, layer_dir)
    for model_dir, ref_file in refs.items():
        check_against_reference(model_dir, dist, torch.load(ref_file))
        # Each rank holds half the KV heads: the padded batch's cache is split, not replicated.
        config = AutoConfig.from_pretrained(model_dir)
        model = load_tp_model(model_dir, config, torch.float32, CPU, dist)
        cache = model(torch.tensor([[1, 2, 3]])).past_key_values
        assert cache.keys[0].shape[1] == config.num_key_value_heads // world_size
    # Both ranks are done with every collective; then exit without the interpreter's finalization. Its last
    # garbage collection could destroy the gloo group, whose worker thread then took the GIL of a finalizing
    # interpreter and the rank aborted ("terminate called without an active exception"; seen in gdb).
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, args: tuple, timeout: float) -> None:
    """Spawn `world_size` ranks of `_rank_main`; any rank's exception fails the test; bounded wait."""
    ctx = mp.start_processes(
        _rank_main, args=(world_size, free_port(), *args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout}s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def test_two_ranks_match_unsharded_layers_and_transformers(tmp_path: Path, built: dict[str, Path]) -> None:
    g = torch.Generator().manual_seed(0)
    layer_dir = tmp_path / "layers"
    layer_dir.mkdir()
    save_file(
        {
            "col.weight": torch.randn(8, 6, generator=g),
            "col.bias": torch.randn(8, generator=g),
            "row.weight": torch.randn(6, 8, generator=g),
            "row.bias": torch.randn(6, generator=g),
            "emb.weight": torch.randn(11, 6, generator=g),
            "head.weight": torch.randn(10, 6, generator=g),
        },
        str(layer_dir / "layers.safetensors"),
    )
    refs = {}
    for name, model_dir in (
        ("qwen2", built["qwen2"]),
        ("tied", random_model_dir(tmp_path / "tied", VARIANTS["llama3-tied-bias"])),
    ):
        refs[model_dir] = tmp_path / f"{name}.ref"
        torch.save(reference(model_dir), refs[model_dir])
    run_ranks(2, (layer_dir, refs), timeout=120)
