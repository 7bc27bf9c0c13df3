"""W3, vision-language load: concurrent chat requests with an image each, through the real launcher, against
transformers' static batching in-process on the same model; and the prefix cache on a repeated image.

n requests (32), each one seeded random JPEG (sides drawn from 224 to 896 pixels) as an OpenAI `image_url` part
(a data URI) and a short question, 64 new tokens each, greedy (temperature 0), streamed from
/v1/chat/completions, all sent at once to one launcher with PREFIX_CACHING=1. Throughput: generated tokens over
the wall time from the first send to the last token. Then the prefix cache on images: `--repeats` times a new
image and question is sent alone, then the same request again; TTFT p50 of the repeats over that of the firsts.

transformers' side: the model's own processor on the same images and questions through the model's chat
template, one left-padded batch, `generate` with 64 new tokens each (min_new_tokens, so none stops early),
timed from the processor call to the last token; its throughput is n x 64 over that time.

The model is vlm_builder's `small` size of the family (~200M parameters, about SmolVLM-256M; built once under
models/). Both sides run float32 (a CPU shard's default) on `--threads` threads.

    python benchmark/vlm_load.py [--arch llava_next,idefics3,qwen2_vl,qwen2_5_vl] [-n 32]
        [--max-new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

from textgen_benchmark import engine
from textgen_benchmark.servers import DECODE, PREFILL, growth, scrape
from textgen_benchmark.sse_client import sse_events
from textgen_benchmark.stats import Latency
from textgen_benchmark.table import markdown_table
from textgen_common.image_prompts import image_text, load_processor
from textgen_server.build_choices import VLM_ARCHS

SIDES = (224, 320, 448, 576, 704, 896)
QUESTIONS = ("What is in this picture?", "Describe the image.", "Which colours do you see?", "Is it a photo?")
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Job:
    image: bytes  # JPEG
    question: str


def make_jobs(n: int, seed: int) -> list[Job]:
    """`n` seeded random images (each side one of SIDES) and questions."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        width, height = rng.choice(SIDES), rng.choice(SIDES)
        pixels = np.random.RandomState(rng.randrange(2**31)).randint(0, 256, (height, width, 3), dtype=np.uint8)
        data = io.BytesIO()
        Image.fromarray(pixels).save(data, format="JPEG", quality=85)
        jobs.append(Job(data.getvalue(), rng.choice(QUESTIONS)))
    return jobs


def chat_body(job: Job, max_new_tokens: int) -> dict:
    url = "data:image/jpeg;base64," + base64.b64encode(job.image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": job.question}]
    return {
        "model": "tgi",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Answer:
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # one per streamed chunk with content
    tokens: int = 0  # the usage chunk's completion tokens (a token may stream no text of its own)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None


async def chat(url: str, body: dict) -> Answer:
    """Stream one chat completion; an HTTP or stream error is recorded, not raised."""
    address = urlsplit(url)
    assert address.hostname is not None and address.port is not None
    answer = Answer(sent=time.perf_counter())
    try:
        events = sse_events(address.hostname, address.port, "/v1/chat/completions", body)
        async with contextlib.aclosing(events):
            async for now, data in events:
                if data == b"[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    answer.error = str(payload["error"])
                    break
                answer.tokens = (payload.get("usage") or {}).get("completion_tokens", answer.tokens)
                choices = payload.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    answer.arrivals.append(now)
    except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as err:
        answer.error = repr(err)
    return answer


async def burst(url: str, jobs: list[Job], max_new_tokens: int) -> list[Answer]:
    return list(await asyncio.gather(*(chat(url, chat_body(job, max_new_tokens)) for job in jobs)))


def prompt_tokens(model: Path, jobs: list[Job]) -> list[int]:
    """Each job's prompt length as the router counts it (the processor on the chat template's text)."""
    processor = load_processor(model)
    lengths = []
    for job in jobs:
        text, images = chat_inputs(processor, job)
        lengths.append(int(processor(text=text, images=images, return_tensors="pt")["input_ids"].shape[1]))
    return lengths


def chat_inputs(processor, job: Job) -> tuple[str, list[Image.Image]]:  # type: ignore[no-untyped-def]
    """The chat template's text for `job` and its image: the message is the image, then the question, as the
    router flattens the chat's parts (its markdown image there becomes the processor's image token)."""
    messages = [{"role": "user", "content": image_text(processor) + job.question}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, [Image.open(io.BytesIO(job.image)).convert("RGB")]


def textgen(args: argparse.Namespace, model: Path, jobs: list[Job], repeats: list[Job]) -> dict:
    lengths = prompt_tokens(model, jobs + repeats)
    max_input = max(lengths) + 64  # the router's template may differ from the processor's by a few tokens
    flags = [
        *("--max-input-tokens", str(max_input), "--max-total-tokens", str(max_input + args.max_new_tokens)),
        *("--max-batch-prefill-tokens", str(max(args.max_batch_prefill_tokens, max_input))),
        *("--max-concurrent-requests", str(len(jobs) + 8)),
    ]
    server = engine.start(f"vlm-load-{model.name}", model, "float32", args.threads, flags, {"PREFIX_CACHING": "1"})
    try:
        warm = asyncio.run(chat(server.url, chat_body(make_jobs(1, seed=args.seed + 1)[0], 2)))
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        m0, t0 = scrape(server.url), time.perf_counter()
        answers = asyncio.run(burst(server.url, jobs, args.max_new_tokens))
        wall = max((a.arrivals[-1] for a in answers if a.arrivals), default=t0) - t0
        delta = growth(m0, scrape(server.url))
        firsts, again = [], []
        for job in repeats:
            firsts.append(asyncio.run(chat(server.url, chat_body(job, 4))))
            again.append(asyncio.run(chat(server.url, chat_body(job, 4))))
    finally:
        server.stop()
    tokens = sum(a.tokens for a in answers)
    errors = [a.error for a in answers + firsts + again if a.error]
    first_ms = Latency.of([a.ttft * 1e3 for a in firsts if a.ttft is not None]).p50
    again_ms = Latency.of([a.ttft * 1e3 for a in again if a.ttft is not None]).p50
    return {
        "prompt_tokens_p50": sorted(lengths)[len(lengths) // 2],
        "prompt_tokens_max": max(lengths),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "generated_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall if wall > 0 else float("nan"),
        # The shard's forward seconds: prefills (image features and prompt tokens) and decode steps.
        "prefill_forward_s": delta.get("tgi_batch_forward_duration_sum" + PREFILL, 0.0),
        "decode_forward_s": delta.get("tgi_batch_forward_duration_sum" + DECODE, 0.0),
        "ttft_p50_ms": Latency.of([a.ttft * 1e3 for a in answers if a.ttft is not None]).p50,
        "repeat_first_ttft_p50_ms": first_ms,
        "repeat_again_ttft_p50_ms": again_ms,
        "repeat_ratio": again_ms / first_ms,
    }


def transformers_static(args: argparse.Namespace, model: Path, jobs: list[Job]) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    torch.set_num_threads(args.threads)
    processor = load_processor(model)
    processor.tokenizer.padding_side = "left"
    vlm = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    inputs = [chat_inputs(processor, job) for job in jobs]
    start = time.perf_counter()
    batch = processor(
        text=[text for text, _ in inputs], images=[images for _, images in inputs], padding=True, return_tensors="pt"
    )
    with torch.inference_mode():
        out = vlm.generate(
            **batch, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False
        )
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * len(jobs)
    return {"generated_tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=",".join(VLM_ARCHS), help="comma list of vision-language families")
    p.add_argument("--size", default="small", help="vlm_builder size (tiny: a quick check of the script)")
    p.add_argument("-n", type=int, default=32, help="concurrent requests")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4, help="image+prompt pairs sent twice for the cache's TTFT")
    p.add_argument("--max-batch-prefill-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    engine.stop_on_sigterm()
    from textgen_server.vlm_builder import VLM_BUILDER_VERSION, build_test_vlm

    rows = []
    for arch in args.arch.split(","):
        model = build_test_vlm(ROOT / "models" / f"{arch}-{args.size}-vlm{VLM_BUILDER_VERSION}", arch, size=args.size)
        jobs = make_jobs(args.n, args.seed)
        repeats = make_jobs(args.repeats, args.seed + 2)
        served = textgen(args, model, jobs, repeats)
        static = transformers_static(args, model, jobs)
        rows.append(
            {
                "arch": arch,
                **served,
                "transformers_tok_s": static["throughput_tok_s"],
                "transformers_wall_s": static["wall_s"],
                "ratio": served["throughput_tok_s"] / static["throughput_tok_s"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    header = ["family", "prompt tokens p50 / max", "textgen tok/s", "transformers static tok/s", "ratio (>= 3)"]
    header += [
        "prefill / decode forward s",
        "burst TTFT p50 ms",
        "repeat TTFT p50 first / again ms",
        "again / first (<= 0.3)",
        "errors",
    ]
    table = [
        [r["arch"], f"{r['prompt_tokens_p50']} / {r['prompt_tokens_max']}", f"{r['throughput_tok_s']:.1f}"]
        + [f"{r['transformers_tok_s']:.1f}", f"{r['ratio']:.2f}"]
        + [f"{r['prefill_forward_s']:.1f} / {r['decode_forward_s']:.1f}", f"{r['ttft_p50_ms']:.0f}"]
        + [f"{r['repeat_first_ttft_p50_ms']:.0f} / {r['repeat_again_ttft_p50_ms']:.0f}", f"{r['repeat_ratio']:.2f}"]
        + [str(r["errors"])]
        for r in rows
    ]
    print(
        f"W3: {args.n} chat requests, one image each, {args.max_new_tokens} new tokens, float32, {args.threads} threads"
    )
    print(markdown_table(header, table))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
