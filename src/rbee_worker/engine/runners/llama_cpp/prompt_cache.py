"""A host-memory cache of saved sequence states, looked up by their tokens' longest common prefix, for a runtime whose
KV memory the block pool does not describe (llama.cpp's: engine/runners/llama_cpp/llama_cpp_runner.py), as
llama-server's `--cache-ram`.

An entry is the tokens a sequence held (positions 0..n-1), the runtime's saved state of those positions (opaque
bytes), and how many of its first positions are exact: computed as a fresh run computes them (the runtime says which;
llama.cpp's: with no other sequence in its KV pool). Entries are kept least recently used first within a byte budget.
An entry whose tokens begin another's is redundant: inserting an extension replaces it, and inserting what an entry
already extends only refreshes that entry.
"""

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from rbee_worker.engine.runners.protocol import PrefixHit
from rbee_worker.engine.scheduling.kv_blocks import common_prefix

# A saved state: its bytes (uint8), allocated without zeroing: a bytearray of a long sequence's state (hundreds of MB)
# is zeroed with the GIL held, which stalls every other thread (the HTTP server's) for as long.
State = np.ndarray


class PromptCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, ...], State] = OrderedDict()  # least recently used first
        self._exact: dict[tuple[int, ...], int] = {}  # each entry's exact first positions

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, token_ids: Sequence[int]) -> tuple[int, tuple[int, ...] | None]:
        """The entry sharing the longest prefix with `token_ids`, and how long that prefix is: (0, None) when none
        shares a token. Among entries sharing as much, one whose shared prefix is exact (or exact the furthest)."""
        wanted = tuple(token_ids)
        best, key = (0, 0), None
        for tokens in self._entries:
            found = common_prefix(tokens, wanted)
            if (rank := (found, min(found, self._exact[tokens]))) > best:
                best, key = rank, tokens
        return best[0], key

    def exact(self, key: tuple[int, ...]) -> int:
        """How many first positions of an entry are exact."""
        return self._exact[key]

    def take(self, key: tuple[int, ...]) -> State:
        """The saved state of an entry found by `longest`, now the most recently used."""
        self._entries.move_to_end(key)
        return self._entries[key]

    def covers(self, token_ids: Sequence[int]) -> bool:
        """Whether an entry holds all of `token_ids` (and maybe more); that entry becomes the most recently used."""
        wanted = tuple(token_ids)
        for tokens in self._entries:
            if tokens[: len(wanted)] == wanted:
                self._entries.move_to_end(tokens)
                return True
        return False

    def insert(self, token_ids: Sequence[int], state: State, exact: int | None = None) -> None:
        """A new entry, the most recently used, its first `exact` positions exact (None: all); the entries it extends
        go, then the least recently used ones while the cache holds more than its budget. A state larger than the
        whole budget is not kept."""
        if len(state) > self.budget_bytes:
            return
        key = tuple(token_ids)
        for tokens in [t for t in self._entries if key[: len(t)] == t]:
            self._drop(tokens)
        self._entries[key] = state
        self._exact[key] = len(key) if exact is None else min(exact, len(key))
        self.bytes += len(state)
        while self.bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))

    def discard(self, key: tuple[int, ...]) -> None:
        """An entry goes (one whose state the runtime could not restore)."""
        if key in self._entries:
            self._drop(key)

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes -= len(self._entries.pop(key))
        del self._exact[key]


class SavedPrefixes:
    """The Runner.prefixes of llama.cpp's runtime (protocol.RuntimePrefixes), what it holds for the scheduler to plan
    prompts with: its saved states (`prompts`) and, unless `saved_only`, each batch row's sequence (`held`: its tokens
    at positions 0..n-1, `exact`: how many first ones are exact; the runner's own lists, which it keeps up to date).
    Reading it changes nothing: the runner restores a hit when the plan runs (Runner.restore)."""

    def __init__(
        self, prompts: PromptCache, held: list[list[int]], exact: list[int], least: int, saved_only: bool
    ) -> None:
        self.prompts, self.held, self.exact = prompts, held, exact
        self.least = least  # a shorter prefix is not worth restoring (a block's worth)
        self.saved_only = saved_only

    def find(self, row: int, token_ids: Sequence[int], limit: int) -> PrefixHit | None:
        """The longest prefix of `token_ids[:limit]` that a saved state or another row's sequence holds; among equal
        ones, an exact one. None under `least` tokens."""
        wanted = list(token_ids[:limit])
        found, key = self.prompts.longest(wanted)
        exact = min(found, self.prompts.exact(key)) if key is not None else 0
        source = None
        if not self.saved_only:
            for other, held in enumerate(self.held):
                if other == row:
                    continue
                shared = common_prefix(held, wanted)
                if (shared, min(shared, self.exact[other])) > (found, exact):
                    found, exact, source = shared, min(shared, self.exact[other]), other
        if found < self.least:
            return None
        return PrefixHit(tuple(wanted[:found]), exact, key if source is None else None, source)
