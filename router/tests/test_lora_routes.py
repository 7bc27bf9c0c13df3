"""LoRA adapters over HTTP, through the real launcher (`--lora-adapters`), router and shard.

`parameters.adapter_id` and the OpenAI `model` field select an adapter (the tokens are peft's on the same
adapter files); an adapter that is not loaded is a 422; /v1/models and /info list the loaded adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from testing.launcher import LauncherProcess
from textgen_server.builder import build_test_adapter

PROMPT = "def fill(self, text):"
MAX_NEW_TOKENS = 6
MESSAGES = [{"role": "user", "content": "What is a list?"}]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_test_adapter(root / name, tiny_llama, seed=seed) for name, seed in (("one", 1), ("two", 2))}


@pytest.fixture(scope="module")
def server(
    launcher: Callable[..., LauncherProcess], tiny_llama: Path, adapters: dict[str, Path]
) -> Iterator[LauncherProcess]:
    spec = ",".join(f"{name}={path}" for name, path in adapters.items())
    handle = launcher(tiny_llama, "--lora-adapters", spec)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def http(server: LauncherProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def peft_greedy(tiny_llama: Path, adapters: dict[str, Path]) -> Callable[[str | None, list[int]], list[int]]:
    """`peft_greedy(adapter or None, prompt ids)`: peft's greedy new token ids."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapters["one"], adapter_name="one")
    model.load_adapter(adapters["two"], adapter_name="two")
    model.eval()

    def greedy(adapter: str | None, ids: list[int]) -> list[int]:
        inputs = torch.tensor([ids])
        with torch.inference_mode():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(input_ids=inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            else:
                model.set_adapter(adapter)
                out = model.generate(input_ids=inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        return out[0, len(ids) :].tolist()

    return greedy


def generate_ids(http: httpx.Client, adapter_id: str | None) -> list[int]:
    parameters: dict[str, object] = {"max_new_tokens": MAX_NEW_TOKENS, "details": True}
    if adapter_id is not None:
        parameters["adapter_id"] = adapter_id
    response = http.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def test_adapter_id_selects_the_adapter(
    http: httpx.Client, server: LauncherProcess, peft_greedy: Callable[[str | None, list[int]], list[int]]
) -> None:
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(server.model_dir)(PROMPT)["input_ids"]
    for adapter in ("one", "two", None):
        assert generate_ids(http, adapter) == peft_greedy(adapter, prompt_ids)
    # The model id itself names the base model.
    assert generate_ids(http, str(server.model_dir)) == peft_greedy(None, prompt_ids)


def test_an_adapter_that_is_not_loaded_is_a_422(http: httpx.Client) -> None:
    response = http.post("/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "three"}})
    assert response.status_code == 422
    assert response.json() == {
        "error": "Input validation error: adapter `three` is not loaded (loaded LoRA adapters: one, two)",
        "error_type": "validation",
    }
    chat = http.post("/v1/chat/completions", json={"model": "three", "messages": MESSAGES, "max_tokens": 2})
    assert chat.status_code == 422
    assert "adapter `three` is not loaded" in chat.json()["error"]


def test_chat_model_selects_the_adapter(
    http: httpx.Client, server: LauncherProcess, peft_greedy: Callable[[str | None, list[int]], list[int]]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    templated = http.post("/chat_tokenize", json={"messages": MESSAGES}).json()["templated_text"]
    prompt_ids = tokenizer(templated, add_special_tokens=False)["input_ids"]
    for model in ("one", "two", "tgi"):
        body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
        answer = http.post("/v1/chat/completions", json=body).json()
        assert answer["model"] == (model if model != "tgi" else str(server.model_dir))
        expected = peft_greedy(model if model != "tgi" else None, prompt_ids)
        assert answer["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
    completion = http.post(
        "/v1/completions", json={"model": "two", "prompt": PROMPT, "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
    ).json()
    two = peft_greedy("two", tokenizer(PROMPT)["input_ids"])
    assert completion["choices"][0]["text"] == tokenizer.decode(two, skip_special_tokens=True)


def test_models_and_info_list_the_adapters(http: httpx.Client, server: LauncherProcess) -> None:
    model = str(server.model_dir)
    assert http.get("/v1/models").json() == {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": model} for name in (model, "one", "two")],
    }
    assert http.get("/info").json()["lora_adapters"] == ["one", "two"]
