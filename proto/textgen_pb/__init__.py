"""Python code generated from proto/v3/generate.proto by `make proto` (package generate.v3).

The generated modules (`generate_pb2`, `generate_pb2_grpc`) are build outputs, ignored by git and
shared by the server, the router and the benchmark from this one place.
"""
