"""The offline model builder: tiny models load with transformers, tokenize cleanly and rebuild identically."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from textgen_server.builder import BUILDER_VERSION, CYCLE_PERIOD, build_cycling_model, build_test_model

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")


def digests(model_dir: Path) -> dict[str, str]:
    return {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest() for name in FILES}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_model(tmp_path_factory.mktemp("builder") / "llama")


def test_tiny_llama_loads_and_generates(llama: Path) -> None:
    config = json.loads((llama / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    # Even heads, kv heads and vocab: 2-shard tensor parallelism must be able to split them.
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    for key in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
        assert config[key] % 2 == 0, key
    model = AutoModelForCausalLM.from_pretrained(llama)
    tok = AutoTokenizer.from_pretrained(llama)
    assert len(tok) == config["vocab_size"] == model.get_input_embeddings().num_embeddings
    inputs = tok("def main():", return_tensors="pt")
    assert inputs.input_ids[0, 0].item() == tok.bos_token_id
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, inputs.input_ids.shape[1] + 8)


def test_tokenizer_round_trips_and_splits_multibyte(llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(llama)
    text = "Hello, wörld! 日本語 🙂\n\tdef f(x): return x ** 2"
    ids = tok(text).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Byte-level BPE: a rare 3-byte character becomes several tokens none of which decodes to it alone.
    char_ids = tok("語", add_special_tokens=False).input_ids
    assert len(char_ids) > 1
    assert all(tok.decode([i]) != "語" for i in char_ids)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


def test_chat_template_in_tokenizer_config(llama: Path) -> None:
    assert "chat_template" in json.loads((llama / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(llama)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") != tok.unk_token_id


def test_rebuild_is_identical_and_reuse_is_free(llama: Path, tmp_path: Path) -> None:
    again = build_test_model(tmp_path / "again")
    assert digests(again) == digests(llama)
    stamp = json.loads((llama / ".textgen-build.json").read_text())
    assert stamp["builder_version"] == BUILDER_VERSION
    mtime = (llama / "model.safetensors").stat().st_mtime_ns
    assert build_test_model(llama) == llama
    assert (llama / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_directory_that_is_not_a_build_is_never_replaced(llama: Path, tmp_path: Path) -> None:
    users = tmp_path / "users-model"
    users.mkdir()
    (users / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a textgen test build"):
        build_test_model(users)
    assert [p.name for p in users.iterdir()] == ["config.json"]
    assert not list(tmp_path.glob("*.building-*"))  # the build beside it is cleaned up
    # Another build of ours is replaced: the same directory rebuilt with another seed.
    other = build_test_model(tmp_path / "ours", seed=1)
    assert build_test_model(other) == other and digests(other) == digests(llama)


def test_cycling_head_is_the_embedding_with_rows_moved_to_their_successors(llama: Path, tmp_path: Path) -> None:
    """Every head row is written, each from one embedding row (none left as uninitialised memory, which once made
    the model loop in one pytest session and not in the next): the vocabulary (1024 ids) ends in a partial group,
    whose ids map to themselves."""
    from safetensors.torch import load_file

    weights = load_file(build_cycling_model(llama, tmp_path / "cycling") / "model.safetensors")
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    vocab = embed.shape[0]
    assert vocab % CYCLE_PERIOD  # the partial group exists
    for i in range(vocab):
        group = i - i % CYCLE_PERIOD
        successor = i if group + CYCLE_PERIOD > vocab else group + (i + 1 - group) % CYCLE_PERIOD
        assert torch.equal(head[successor], embed[i]), f"id {i}"


@pytest.mark.parametrize(
    "arch,cls", [("gpt2", "GPT2LMHeadModel"), ("qwen2", "Qwen2ForCausalLM"), ("mistral", "MistralForCausalLM")]
)
def test_other_archs(tmp_path: Path, arch: str, cls: str) -> None:
    path = build_test_model(tmp_path / arch, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == cls
    if arch == "qwen2":
        bias = model.model.layers[0].self_attn.q_proj.bias
        assert bias is not None and bias.abs().sum() > 0
    logits = model(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape == (1, 3, model.config.vocab_size)


def test_rejects_unknown_arch_and_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'bert'"):
        build_test_model(tmp_path / "x", arch="bert")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        build_test_model(tmp_path / "x", size="huge")


def test_cli_rejects_an_unknown_arch_in_one_line(tmp_path: Path) -> None:
    import subprocess

    proc = subprocess.run(
        ["textgen-server", "build-test-model", str(tmp_path / "m"), "--arch", "bloom"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown arch 'bloom'" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "m").exists()
    # Refused before the builders' imports: torch is never imported (-X importtime lists every module imported).
    traced = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "textgen_server.cli", "build-test-model", str(tmp_path / "m")]
        + ["--arch", "llava_next", "--size", "1b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert traced.returncode == 2 and "unknown size '1b'; expected one of tiny, small" in traced.stdout
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in traced.stderr.splitlines() if line.startswith("import time")
    }
    assert "textgen_server.build_choices" in imported and "torch" not in imported
