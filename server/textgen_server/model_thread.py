"""The shard's model thread: every call that runs the model (load, warmup, steps, health) or touches the batch cache
runs on one thread of its own, in the order it was submitted, while the gRPC event loop runs on the main thread.

Why a thread of its own: while a step ran on the event loop's thread, the loop could neither send the last reply
nor read the next request, so the gRPC round trip added to every step, and a step computed ahead
(decode_ahead.py) could not be interrupted by the RPC that makes it useless. Why always the same one: torch's
CPU kernels run on an OpenMP team that belongs to the thread calling them, and with a second team in the process
(more of the runtime's threads than cores) every team stops spinning between parallel regions: the small model's
batch-1 step took 1.3-1.6x as long (benchmark/README.md, "Decode ahead"). So the model is loaded on this thread
too, and the main thread runs no torch kernel.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def model_thread() -> ThreadPoolExecutor:
    """The executor every such call goes through: one thread, calls in the order submitted, a call's exception
    raised to its caller; `shutdown()` lets the calls queued so far finish."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="textgen-model")
