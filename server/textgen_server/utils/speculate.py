"""N-gram speculation (`--speculate N` on a model without speculator heads): a row's next tokens guessed from
its own history.

The guess: where the row's last two tokens occurred together before (else its last token alone), the tokens
that followed their latest occurrence; when the history ends first, the tokens since that occurrence repeat (a
loop of period p goes on with period p). A repeated phrase, a quoted passage of the prompt or a loop then
verifies several tokens in one forward.

A refused guess is not free on a CPU: the forward computed its tokens for nothing, which costs more the larger
the batch (benchmark/README.md, "N-gram speculation"). So a row whose first guess was refused waits before it
guesses again, 1, 3, 7 then 15 steps, and a confirmed guess ends the wait. TGI copies what followed the *first*
occurrence of the last token and guesses at every step, even with no occurrence; a guess only changes how many
tokens a step emits, never which (models/paged_lm.py verifies every guess with the row's own chooser), so the
rule is the shard's own.
"""

from __future__ import annotations

# The longest wait after refused guesses, in steps: a row of text that never repeats guesses once in 16 steps.
MAX_WAIT = 15


class NGramIndex:
    """Where each token, and each pair of consecutive tokens, of one row's history last ended, and how long the
    row waits before it guesses again.

    The index grows with the row: `propose` first indexes the positions added since its last call, so a step
    costs the new tokens, not the history.
    """

    def __init__(self) -> None:
        self._singles: dict[int, int] = {}
        self._pairs: dict[tuple[int, int], int] = {}
        self._indexed = 0  # positions [0, _indexed) are in the maps
        self._misses = 0  # guesses refused in a row
        self._wait = 0  # steps left before the next guess

    def record(self, guessed: int, confirmed: int) -> None:
        """The outcome of the last step's guesses: `guessed` tokens fed, the first `confirmed` of them emitted."""
        if not guessed:
            return
        if confirmed:
            self._misses = 0
        else:
            self._misses += 1
            self._wait = min(2**self._misses - 1, MAX_WAIT)

    def propose(self, ids: list[int], limit: int) -> list[int]:
        """`limit` tokens after the latest earlier occurrence of the end of `ids` (the row's prompt and
        generated tokens), repeating the tokens since then where the history ends; [] when it has none, `limit`
        is 0 or the row is waiting after refused guesses."""
        # Every position but the last: the last is what is looked up, and must have a token after it.
        end = len(ids) - 1
        for p in range(self._indexed, end):
            self._singles[ids[p]] = p
            if p:
                self._pairs[(ids[p - 1], ids[p])] = p
        self._indexed = max(self._indexed, end)
        if self._wait:
            self._wait -= 1
            return []
        if limit <= 0 or end < 1:
            return []
        found = self._pairs.get((ids[-2], ids[-1]))
        if found is None:
            found = self._singles.get(ids[-1])
        if found is None:
            return []
        period = end - found
        return [ids[found + 1 + k % period] for k in range(limit)]
