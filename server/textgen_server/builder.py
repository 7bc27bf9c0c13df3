"""Builds small real models offline: seeded random weights plus a byte-level BPE tokenizer trained locally.

No model hub is reachable from the machines this project runs on, so tests, the demo and the benchmarks use
models built here. A built directory is a normal Hugging Face checkpoint (``config.json``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with a ChatML-like chat template,
``model.safetensors``) that ``AutoModelForCausalLM`` / ``AutoTokenizer`` load as is.

Contract for callers (the ``textgen-server build-test-model DIR --arch A --size S [--seed N]`` CLI and the test
fixtures): ``build_test_model(out_dir, arch, size, seed) -> Path`` is deterministic for a given
``BUILDER_VERSION``, Python minor version (the tokenizer corpus is stdlib source) and torch version, and
returns at once when ``out_dir`` already holds the same build (a ``.textgen-build.json`` stamp says which).
Cache built models by ``BUILDER_VERSION``: it is bumped whenever the output changes.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from textgen_server.build_choices import TEXT_ARCHS, TEXT_SIZES, check_choice

BUILDER_VERSION = 1

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

# ChatML-like; `add_generation_prompt` opens the assistant turn the way chat models expect.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed stdlib files as training text, read in this order: identical bytes on every machine with the same
# Python minor version. Modules removed in 3.12/3.13 are left out so the list survives upgrades.
TINY_CORPUS = (
    "textwrap.py",
    "string.py",
    "colorsys.py",
    "bisect.py",
    "heapq.py",
    "fractions.py",
    "queue.py",
    "shlex.py",
)
LARGE_CORPUS = TINY_CORPUS + (
    "_pydecimal.py",
    "turtle.py",
    "inspect.py",
    "typing.py",
    "pydoc.py",
    "tarfile.py",
    "doctest.py",
    "argparse.py",
    "_pyio.py",
    "pickletools.py",
    "zipfile.py",
    "datetime.py",
    "subprocess.py",
    "difflib.py",
    "locale.py",
    "enum.py",
    "mailbox.py",
    "ipaddress.py",
    "pickle.py",
    "pdb.py",
    "ast.py",
    "optparse.py",
    "dataclasses.py",
    "threading.py",
    "shutil.py",
    "configparser.py",
    "imaplib.py",
    "ssl.py",
    "pathlib.py",
    "statistics.py",
    "smtplib.py",
    "platform.py",
    "traceback.py",
    "os.py",
    "functools.py",
    "socket.py",
    "codecs.py",
    "ftplib.py",
    "bdb.py",
    "random.py",
    "zipimport.py",
    "ntpath.py",
    "_collections_abc.py",
    "tempfile.py",
    "pstats.py",
    "trace.py",
    "dis.py",
    "plistlib.py",
    "uuid.py",
    "socketserver.py",
    "contextlib.py",
    "tokenize.py",
    "_strptime.py",
)
# The 1b model's 32000-token vocabulary needs more text than the small one's 16000.
HUGE_CORPUS = LARGE_CORPUS + (
    "logging/__init__.py",
    "unittest/mock.py",
    "http/client.py",
    "http/server.py",
    "urllib/request.py",
    "urllib/parse.py",
    "email/_header_value_parser.py",
    "asyncio/base_events.py",
    "tkinter/__init__.py",
    "xml/dom/minidom.py",
    "multiprocessing/connection.py",
    "concurrent/futures/_base.py",
    "calendar.py",
    "gettext.py",
    "csv.py",
    "selectors.py",
    "weakref.py",
    "copy.py",
    "gzip.py",
    "base64.py",
    "pprint.py",
    "types.py",
    "warnings.py",
    "mimetypes.py",
    "fileinput.py",
    "posixpath.py",
    "code.py",
    "cmd.py",
    "profile.py",
    "sysconfig.py",
    "getopt.py",
    "glob.py",
    "hmac.py",
    "netrc.py",
    "numbers.py",
    "operator.py",
    "quopri.py",
    "sched.py",
    "signal.py",
    "struct.py",
    "symtable.py",
    "timeit.py",
    "tracemalloc.py",
    "wave.py",
    "webbrowser.py",
    "zipapp.py",
    "modulefinder.py",
    "filecmp.py",
    "graphlib.py",
    "runpy.py",
)


@dataclass(frozen=True)
class Dims:
    """Shape of one size; vocab, heads and intermediate are even so 2-way tensor parallelism splits them."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    dtype: torch.dtype
    corpus: tuple[str, ...]


SIZE_DIMS: dict[str, Dims] = {
    "tiny": Dims(64, 2, 4, 2, 128, 1024, 2048, torch.float32, TINY_CORPUS),
    "small": Dims(768, 12, 12, 12, 2048, 16000, 2048, torch.float32, LARGE_CORPUS),
    # GPU measurements only; no test builds it (bf16 halves the 4 GB an fp32 copy would take).
    "1b": Dims(2048, 16, 16, 8, 5632, 32000, 4096, torch.bfloat16, HUGE_CORPUS),
}

# Wider than the usual 0.02 so a random tiny model has clear greedy winners: near-ties between logits would
# let batched and unbatched float rounding pick different tokens and make greedy-equality tests flaky.
INIT_STD = 0.2

STAMP = ".textgen-build.json"


def corpus_texts(files: tuple[str, ...]) -> list[str]:
    """The training text: the named stdlib files that exist here, in the given order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in files if (stdlib / name).is_file()]


def train_tokenizer(vocab_size: int, files: tuple[str, ...], add_bos: bool) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): any text encodes, and multi-byte characters may split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(files), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer corpus too small: {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The id of each of SPECIAL_TOKENS in the trained tokenizer (the trainer adds them all first)."""
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise RuntimeError(f"the trained tokenizer lacks the special token {token}")
        ids[token] = token_id
    return ids


def model_config(arch: str, d: Dims, ids: dict[str, int]) -> PretrainedConfig:
    """The transformers config for `arch` at dims `d` with the tokenizer's special ids."""
    common: dict[str, Any] = dict(
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        vocab_size=d.vocab,
        initializer_range=INIT_STD,
    )
    if arch == "gpt2":
        return GPT2Config(
            n_embd=d.hidden,
            n_layer=d.layers,
            n_head=d.heads,
            n_inner=d.intermediate,
            n_positions=d.max_positions,
            **common,
        )
    llama_like: dict[str, Any] = dict(
        hidden_size=d.hidden,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        intermediate_size=d.intermediate,
        max_position_embeddings=d.max_positions,
        tie_word_embeddings=False,
        **common,
    )
    if arch == "llama":
        return LlamaConfig(**llama_like)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **llama_like)
    if arch == "qwen2":
        return Qwen2Config(**llama_like)  # q/k/v projections carry a bias in Qwen2
    raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(TEXT_ARCHS)}")


MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}


def random_model(arch: str, config: PretrainedConfig, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    """Seeded random weights; biases get noise too so a bias-handling bug cannot hide behind zeros."""
    torch.manual_seed(seed)
    model = MODEL_CLASSES[arch](config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, INIT_STD)
    # transformers types PreTrainedModel.to as its functools.wraps wrapper, which drops the bound `self`
    return model.to(dtype).eval()  # type: ignore[arg-type]


def build_test_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
    """Build (or reuse) a random `arch` model of `size` in `out_dir`; returns the directory.

    arch: llama | gpt2 | mistral | qwen2. size: tiny (seconds, for tests) | small (~110M, benchmarks) |
    1b (GPU measurements only). Raises ValueError for an unknown arch or size.
    """
    check_choice("arch", arch, TEXT_ARCHS)
    check_choice("size", size, TEXT_SIZES)
    out = Path(out_dir)
    stamp = {"builder_version": BUILDER_VERSION, "arch": arch, "size": size, "seed": seed}
    if is_built(out, stamp):
        return out
    d = SIZE_DIMS[size]
    # Build beside the target and rename at the end so a crash never leaves a half-written model behind;
    # the pid keeps two test runs building the same cached model from writing into one directory.
    tmp = out.with_name(f"{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    raw = train_tokenizer(d.vocab, d.corpus, add_bos=arch in ("llama", "mistral"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=d.max_positions,
    )
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json, where TGI looks for it.
    tokenizer.save_pretrained(tmp, save_jinja_files=False)

    ids = special_token_ids(raw)
    config = model_config(arch, d, ids)
    model = random_model(arch, config, d.dtype, seed)
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    model.save_pretrained(tmp, safe_serialization=True)
    return publish(tmp, out, stamp)


def publish(tmp: Path, out: Path, stamp: dict[str, Any], stamp_name: str = STAMP) -> Path:
    """Stamp the build in `tmp` (file `stamp_name`) and rename it to `out`, unless a concurrent identical build got
    there first. The quantized builders (quant_builder.py, ct_builder.py) publish their builds the same way.

    An `out` that holds files but no stamp is not a build of ours: FileExistsError, and nothing is deleted."""
    (tmp / stamp_name).write_text(json.dumps(stamp))
    if not is_built(out, stamp, stamp_name):
        if out.is_dir() and any(out.iterdir()) and not (out / stamp_name).is_file():
            # Another build of ours is replaced; anything else (a user's model) is never deleted.
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(f"{out} holds files that are not a textgen test build: not replaced")
        shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:
            if not is_built(out, stamp, stamp_name):  # lost the race to a concurrent identical build: keep theirs
                raise
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_built(out: Path, stamp: dict[str, Any], stamp_name: str = STAMP) -> bool:
    """Whether `out` holds a finished build whose stamp equals `stamp`."""
    stamp_file = out / stamp_name
    return stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp


def build_test_adapter(
    out_dir: str | Path, model_dir: str | Path, rank: int = 8, alpha: int = 16, seed: int = 1
) -> Path:
    """Write a seeded random PEFT LoRA adapter for the Llama-family model in `model_dir`; returns `out_dir`.

    `adapter_config.json` + `adapter_model.safetensors` under PEFT's names, every layer's q/k/v/o and
    gate/up/down targeted. Unlike a freshly initialised PEFT adapter (B = 0), B is random too, so the adapter
    really changes what the model generates. Deterministic for a given seed, rank and model.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from textgen_server.adapters import base_shapes, lora_key
    from textgen_server.models.tp_llama import TP_MODEL_TYPES

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in TP_MODEL_TYPES:
        raise ValueError(f"test adapters are for {', '.join(sorted(TP_MODEL_TYPES))} models, not {config.model_type!r}")
    shapes = base_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            # A as PEFT's kaiming init scales it; B of the base weights' scale (PEFT would start it at zero).
            tensors[lora_key(layer, module, "A")] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[lora_key(layer, module, "B")] = torch.randn(fan_out, rank, generator=generator) * INIT_STD
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(f"{module}_proj" for module in shapes),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


# The period of the loop a cycling model's greedy text falls into.
CYCLE_PERIOD = 5


def build_cycling_model(source: str | Path, out_dir: str | Path) -> Path:
    """A copy of the Llama model `source` made to loop, for n-gram speculation's tests and benchmark.

    No attention or MLP output (o_proj and down_proj zero), so a position's logits depend on its own token only,
    and an LM head that puts each token's embedding on the row of its successor in a cycle of CYCLE_PERIOD ids:
    greedy text repeats every CYCLE_PERIOD tokens (the case speculation is for, with every guess confirmed), and
    every position of a step still has logits of its own. Returns at once when `out_dir` holds it already.
    """
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    stamp = {"cycling_of": str(source), "period": CYCLE_PERIOD, "partial_group": "identity"}
    if is_built(out, stamp):
        return out
    tmp = out.with_name(f"{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    weights = load_file(tmp / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed = weights["model.embed_tokens.weight"]
    ids = torch.arange(embed.shape[0])
    group = (ids // CYCLE_PERIOD) * CYCLE_PERIOD
    successor = group + (ids % CYCLE_PERIOD + 1) % CYCLE_PERIOD
    # The ids of a last, partial group map each to itself, so that `successor` is a permutation and every row of
    # the head is written (a row no id maps to would keep whatever memory it was given).
    partial = group + CYCLE_PERIOD > embed.shape[0]
    successor[partial] = ids[partial]
    head = torch.empty_like(embed)
    head[successor] = embed
    weights["lm_head.weight"] = head
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    return publish(tmp, out, stamp)
