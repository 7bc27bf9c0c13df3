"""Request builders and the transformers oracle shared by the shard tests (imported, not fixtures)."""

from __future__ import annotations

from pathlib import Path

from textgen_pb import generate_pb2 as pb


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

    def log_softmax(self, text: str):  # -> torch.Tensor [seq, vocab]
        import torch

        ids = self.tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            return torch.log_softmax(self.model(**ids).logits[0].float(), -1)
