"""The launcher's probe of a shard: whether its socket answers generate.v3's Health."""

from __future__ import annotations

import os

import grpc

from textgen_pb import generate_pb2, generate_pb2_grpc

HEALTH_TIMEOUT_S = 2.0


def answers_health(path: str) -> bool:
    """Whether a shard listens on the unix socket `path` and answers Health within HEALTH_TIMEOUT_S."""
    if not os.path.exists(path):
        return False
    # A fresh channel per probe: a channel that failed once would wait out gRPC's reconnect backoff.
    with grpc.insecure_channel(f"unix://{path}") as channel:
        try:
            generate_pb2_grpc.TextGenerationServiceStub(channel).Health(
                generate_pb2.HealthRequest(), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
    return True
