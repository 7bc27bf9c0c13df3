"""Helpers every textgen process uses (launcher, router, shards, benchmarks, tests), kept apart from any one of
them so that no package reaches into another for them: logging set-up, listen addresses, free loopback ports,
the gRPC options of the shard link.
"""
