"""When a request stops generating, checked once per generated token.

Contract with the batch: `StoppingCriteria.from_pb(pb, eos_token_ids)` per request, then
`criteria(token_id, token_text) -> (stop, finish_reason)` for each new token, where `token_text` is the
streamed text that token added (possibly ""). Checks run in TGI's order: length first (so a last token that
is also EOS reports LENGTH), then EOS unless ignore_eos_token, then stop sequences at the end of the text
generated so far, which may span several tokens.
"""

from __future__ import annotations

from collections.abc import Set

from textgen_pb import generate_pb2


class StoppingCriteria:
    """Per-request stopping state: tokens generated so far and the tail of their text."""

    def __init__(
        self,
        eos_token_ids: Set[int],
        stop_sequences: list[str],
        max_new_tokens: int,
        ignore_eos_token: bool = False,
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.stop_sequences = stop_sequences
        self.max_new_tokens = max_new_tokens
        self.ignore_eos_token = ignore_eos_token
        self.current_tokens = 0
        # Only the last few characters can complete a stop sequence (+1 for the trailing newline rule).
        self._tail_length = max((len(s) for s in stop_sequences), default=0) + 1
        self._tail = ""

    @classmethod
    def from_pb(cls, pb: generate_pb2.StoppingCriteriaParameters, eos_token_ids: Set[int]) -> StoppingCriteria:
        return cls(eos_token_ids, list(pb.stop_sequences), pb.max_new_tokens, pb.ignore_eos_token)

    def __call__(self, last_token_id: int, last_token_text: str) -> tuple[bool, generate_pb2.FinishReason | None]:
        """Record one generated token; (True, reason) when the request must stop now."""
        self.current_tokens += 1
        if self.current_tokens >= self.max_new_tokens:
            return True, generate_pb2.FINISH_REASON_LENGTH
        if not self.ignore_eos_token and last_token_id in self.eos_token_ids:
            return True, generate_pb2.FINISH_REASON_EOS_TOKEN
        if self.stop_sequences:
            self._tail = (self._tail + last_token_text)[-self._tail_length :]
            for stop in self.stop_sequences:
                # TGI matches `re.escape(stop) + "$"`, and Python's `$` also matches before one final
                # newline; keep that so the same requests stop at the same token.
                if self._tail.endswith(stop) or self._tail.endswith(stop + "\n"):
                    return True, generate_pb2.FINISH_REASON_STOP_SEQUENCE
        return False, None
