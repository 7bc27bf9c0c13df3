"""gRPC channel and server options of the generate.v3 link, the same on both ends (router, shards, tests).

A batch's protobuf messages grow with batch size and prompt length (a prefill carries every prompt, its
response the prefill tokens); gRPC's 4 MiB default would refuse a large batch, so both directions allow the
largest message gRPC accepts.
"""

from __future__ import annotations

MAX_MESSAGE_LENGTH = 2**31 - 1
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_LENGTH),
    ("grpc.max_send_message_length", MAX_MESSAGE_LENGTH),
]
