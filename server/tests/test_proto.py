"""The generated protobuf code is current, and the wire contract is TGI's generate.v3."""

from __future__ import annotations

import subprocess
from pathlib import Path

from textgen_pb import generate_pb2

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("generate_pb2.py", "generate_pb2_grpc.py", "generate_pb2.pyi")


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    subprocess.run(["make", "-s", "-C", str(ROOT), "proto", f"PROTO_OUT={tmp_path}"], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "textgen_pb" / name).read_text()
        current = (ROOT / "proto" / "textgen_pb" / name).read_text()
        assert fresh == current, f"{name} is stale: run `make proto`"


def _fields(message: str) -> dict[str, tuple[int, int, bool]]:
    desc = generate_pb2.DESCRIPTOR.message_types_by_name[message]
    return {f.name: (f.number, f.type, f.is_repeated) for f in desc.fields}


def test_wire_contract_matches_tgi_generate_v3() -> None:
    from google.protobuf.descriptor import FieldDescriptor as F

    assert generate_pb2.DESCRIPTOR.package == "generate.v3"
    service = generate_pb2.DESCRIPTOR.services_by_name["TextGenerationService"]
    assert [m.name for m in service.methods] == [
        "Info",
        "ServiceDiscovery",
        "ClearCache",
        "FilterBatch",
        "Warmup",
        "Prefill",
        "Decode",
        "Health",
    ]
    request = _fields("Request")
    assert request["id"] == (1, F.TYPE_UINT64, False)
    assert request["input_chunks"] == (8, F.TYPE_MESSAGE, False)
    assert request["inputs"] == (2, F.TYPE_STRING, False)
    assert request["prefill_logprobs"] == (6, F.TYPE_BOOL, False)
    assert request["top_n_tokens"] == (7, F.TYPE_UINT32, False)
    assert request["slots"] == (10, F.TYPE_UINT32, True)
    assert request["add_special_tokens"] == (13, F.TYPE_BOOL, False)
    assert request["chunk_len"] == (14, F.TYPE_UINT32, False)
    params = _fields("NextTokenChooserParameters")
    assert params["frequency_penalty"] == (9, F.TYPE_FLOAT, False)
    assert params["grammar_type"] == (11, F.TYPE_ENUM, False)
    generation = _fields("Generation")
    assert generation["top_tokens"] == (5, F.TYPE_MESSAGE, True)
    assert _fields("CachedBatch")["current_tokens"] == (5, F.TYPE_UINT32, False)
    assert _fields("PrefillResponse")["concat_ns"] == (6, F.TYPE_UINT64, False)
    assert _fields("WarmupResponse")["max_supported_total_tokens"] == (1, F.TYPE_UINT32, False)
    assert _fields("InfoResponse")["block_size"] == (9, F.TYPE_UINT32, False)
    assert generate_pb2.FinishReason.Value("FINISH_REASON_STOP_SEQUENCE") == 2
    assert generate_pb2.GrammarType.Value("GRAMMAR_TYPE_REGEX") == 2
