"""The shard's engines (`Model`: the padded `CausalLM`, the paged `PagedCausalLM`) and the networks they run.

Assembling them from the serve options is `textgen_server/loader.py`'s work, one step above this package:
nothing here imports the loader or `textgen_server.adapters`.
"""
