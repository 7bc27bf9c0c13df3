"""ROPE_SCALING / ROPE_FACTOR (the launcher's --rope-scaling / --rope-factor) replace the model's RoPE scaling.

Oracle: transformers itself, loaded with a config whose rope_parameters carry the same scaling. Every engine
(paged, padded over the tensor-parallel module, padded over transformers' own class) must give its prompt
logprobs, and none may give those of the unscaled model. (That a shard process reads the variables:
test_server.py's start-up errors.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from shard_helpers import make_batch, make_request
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from textgen_server.config import ServeConfig, UnsupportedConfigError
from textgen_server.loader import get_model
from textgen_server.models import tp_llama
from textgen_server.models.causal_lm import CausalLM
from textgen_server.models.model import Model
from textgen_server.models.paged_lm import PagedCausalLM

# Long enough that positions far apart rotate differently at a factor of 2.
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3


def oracle_logprobs(model_dir: Path, rope: dict[str, object] | None) -> torch.Tensor:
    """transformers' logprob of each prompt token after the first, with `rope` as the config's rope_parameters."""
    config = AutoConfig.from_pretrained(model_dir)
    if rope is not None:
        config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **rope}
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logprobs.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)


def shard_logprobs(model: Model) -> torch.Tensor:
    """The shard's prefill logprobs of PROMPT (the first, NaN, left out)."""
    batch = model.batch_type.from_pb(make_batch(1, [make_request(1, PROMPT, 1, prefill_logprobs=True)]), model)
    generations, _, _ = model.generate_token(batch)
    (generation,) = generations
    return torch.tensor(list(generation.prefill_tokens.logprobs)[1:])


@pytest.fixture(scope="module")
def short_context_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with max_position_embeddings 16, fewer than PROMPT's tokens: dynamic NTK scaling only
    changes the angles of a sequence longer than that."""
    target = tmp_path_factory.mktemp("short-context-llama")
    for item in tiny_llama.iterdir():
        if item.is_file():
            shutil.copy2(item, target / item.name)
    config = AutoConfig.from_pretrained(tiny_llama)
    config.max_position_embeddings = 16
    config.save_pretrained(target)
    return target


# engine -> (ServeConfig options, the Model class it loads)
ENGINES: dict[str, tuple[dict[str, bool], type[Model]]] = {
    "paged": ({"request_logprobs": True}, PagedCausalLM),
    "padded": ({"use_flash_attention": False}, CausalLM),
    "transformers-class": ({"use_flash_attention": False}, CausalLM),
}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("scaling", ["linear", "dynamic"])
def test_rope_scaling_replaces_the_model_s_as_transformers_computes_it(
    tiny_llama: Path, short_context_llama: Path, engine: str, scaling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if engine == "transformers-class":  # the llama run as every model outside the tensor-parallel family is
        monkeypatch.setattr(tp_llama, "TP_MODEL_TYPES", set())
    model_dir = short_context_llama if scaling == "dynamic" else tiny_llama
    options, model_class = ENGINES[engine]
    model = get_model(ServeConfig(str(model_dir), rope_scaling=scaling, rope_factor="2.0", **options))
    assert type(model) is model_class
    scaled = shard_logprobs(model)
    assert torch.allclose(scaled, oracle_logprobs(model_dir, {"rope_type": scaling, "factor": 2.0}), atol=1e-4)
    assert not torch.allclose(scaled, oracle_logprobs(model_dir, None), atol=1e-3)


def test_a_model_without_rope_is_refused(tiny_gpt2: Path) -> None:
    serve = ServeConfig(str(tiny_gpt2), rope_scaling="linear", rope_factor="2.0")
    with pytest.raises(UnsupportedConfigError, match="ROPE_SCALING=linear: a gpt2 model has no single rotary"):
        get_model(serve)


@pytest.mark.parametrize(
    ("scaling", "factor", "message"),
    [
        ("yarn", "2.0", "ROPE_SCALING=yarn is not supported; use one of linear, dynamic"),
        ("linear", None, "ROPE_SCALING=linear needs ROPE_FACTOR"),
        (None, "2.0", "ROPE_FACTOR=2.0 without ROPE_SCALING"),
        ("linear", "two", "ROPE_FACTOR=two is not supported: expected a positive number"),
        ("dynamic", "0", "ROPE_FACTOR=0 is not supported"),
        ("linear", "-1.5", "ROPE_FACTOR=-1.5 is not supported"),
        ("linear", "nan", "ROPE_FACTOR=nan is not supported"),
    ],
)
def test_what_no_engine_can_honour_is_refused(scaling: str | None, factor: str | None, message: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=message):
        ServeConfig("any", rope_scaling=scaling, rope_factor=factor).check()
