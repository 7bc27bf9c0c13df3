"""The name a causal LM's forward takes and returns its KV cache under.

transformers renamed the argument and the output field from `past_key_values` to `cache` (5.x; the old name is
deprecated and due to go in 5.40), while older releases and textgen's own modules (tp_llama.TPCausalLM) use
`past_key_values`. Callers ask the module instead of assuming either, and read the output's field of the same
name.
"""

from __future__ import annotations

import inspect

import torch


def cache_keyword(module: torch.nn.Module) -> str:
    """`cache` where `module.forward` has that parameter, else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
