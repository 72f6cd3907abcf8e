"""Prompt lookup: speculative decoding's proposals without a second model, as vLLM's n-gram proposer and
llama.cpp's n-gram drafts make them. The longest suffix of a sequence's tokens (its prompt, then its output), of
`min_n` to `max_n` tokens, is looked for earlier in them; where found, the tokens that followed its earliest
occurrence are proposed to follow the sequence's last token. A rewrite, an edit or a summary quotes its input, so the
proposals are often right there; elsewhere they are few and short.

The search runs on the host every step, as C's substring search over the tokens' int32 bytes (`bytes.find`): about a
microsecond per thousand tokens of context, next to a decode step's milliseconds."""

from array import array
from collections.abc import Sequence as Tokens

from rbee_worker.engine.plan import Sequence

TOKEN_BYTES = 4  # the tokens' width in the searched bytes (int32; token ids are below 2**31)


def propose(tokens: Tokens[int], min_n: int, max_n: int, limit: int) -> tuple[int, ...]:
    """Up to `limit` tokens to follow `tokens`: those after the earliest earlier occurrence of their longest suffix of
    min_n..max_n tokens (a suffix that occurs only as itself proposes nothing)."""
    if limit <= 0 or len(tokens) <= min_n:
        return ()
    data = array("i", tokens).tobytes()
    before_last = data[:-TOKEN_BYTES]  # an occurrence that ends before the last token has a token after it
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = data[-n * TOKEN_BYTES :]
        at = before_last.find(suffix)
        while at > 0 and at % TOKEN_BYTES:  # a match across token boundaries: look on
            at = before_last.find(suffix, at + 1)
        if at >= 0:
            start = at // TOKEN_BYTES + n
            return tuple(tokens[start : start + limit])
    return ()


class NgramProposer:
    """The scheduler's proposer (scheduling/scheduler.py's Proposer) by prompt lookup over a sequence's tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must be 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def __call__(self, sequence: Sequence, limit: int) -> tuple[int, ...]:
        tokens = (*sequence.request.prompt_ids, *sequence.output_ids)
        return propose(tokens, self.min_n, self.max_n, limit)
