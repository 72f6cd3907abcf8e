"""Each batch row's llama.cpp sequence (sequence id = batch row) as the llama.cpp runner tracks it: the tokens it
holds at positions 0..n-1, how many of its first positions were computed with no other sequence in the pool (exact:
what a fresh run computes alike; with a stream per sequence, every position), and its state moved to and from the
prompt cache (engine/runners/llama_cpp/prompt_cache.py) or another running sequence."""

import ctypes
import logging
from collections.abc import Sequence

import llama_cpp.llama_cpp as native
import numpy as np

from rbee_worker.engine.runners.llama_cpp.prompt_cache import PromptCache, State
from rbee_worker.engine.runners.protocol import PrefixHit

log = logging.getLogger(__name__)


class Sequences:
    """The rows' sequences of one llama.cpp context (`unified`: one pool of cells that every sequence draws on)."""

    def __init__(self, context: ctypes.c_void_p, rows: int, unified: bool, prompts: PromptCache) -> None:
        self._context, self._memory = context, native.llama_get_memory(context)
        self.unified, self.prompts = unified, prompts
        self.held: list[list[int]] = [[] for _ in range(rows)]  # each sequence's tokens at positions 0..n-1
        self.exact = [0] * rows  # each sequence's exact first positions

    def restore(self, row: int, hit: PrefixHit) -> bool:
        """The prefix that the runtime's prefix lookup found, given to the row's sequence (emptied first): in a
        unified pool a running sequence shares its cells, otherwise a state (saved, or copied from the running
        sequence) is restored and cut to the prefix. False where llama.cpp cannot restore it: the sequence is left
        empty and the saved state is dropped from the prompt cache."""
        self.clear(row)
        found = len(hit.token_ids)
        if hit.source is not None and self.unified:
            native.llama_memory_seq_cp(self._memory, hit.source, row, 0, found)
        else:
            state = self._state(hit.source) if hit.source is not None else self.prompts.take(hit.key)  # type: ignore[arg-type]
            if not self._restore(row, state):
                log.warning("llama.cpp could not restore a prompt state; computing the prompt whole")
                self.clear(row)
                if hit.key is not None:
                    self.prompts.discard(hit.key)
                return False
            native.llama_memory_seq_rm(self._memory, row, found, -1)
        self.held[row] = list(hit.token_ids)
        self.exact[row] = hit.exact
        return True

    def save(self, row: int, keep: int) -> None:
        """The row's first `keep` positions' state saved to the prompt cache, unless a saved one holds them already
        (the positions after them go)."""
        held = self.held[row][:keep]
        if self.prompts.covers(held):
            return
        native.llama_memory_seq_rm(self._memory, row, keep, -1)
        if (state := self._state(row)).size:
            self.prompts.insert(held, state, self.exact[row])

    def cut(self, row: int, start: int) -> None:
        """The row's sequence before a prompt chunk at `start`: what it holds from `start` on goes (a prefix that
        `restore` gave but that the chunk computes again)."""
        if len(self.held[row]) > start:
            native.llama_memory_seq_rm(self._memory, row, start, -1)
            del self.held[row][start:]
            self.exact[row] = min(self.exact[row], start)

    def clear(self, row: int) -> None:
        """The row's sequence empties: its cells go back to the pool."""
        native.llama_memory_seq_rm(self._memory, row, -1, -1)
        self.held[row] = []
        self.exact[row] = 0

    def alone(self, rows: list[int]) -> bool:
        """Whether a step over these rows computes with no other sequence's cells in its attention: always with a
        stream per sequence; in a unified pool, one row while no other sequence holds a cell."""
        return not self.unified or (
            len(rows) == 1 and not any(held for other, held in enumerate(self.held) if other != rows[0])
        )

    def computed(self, row: int, start: int, tokens: Sequence[int], alone: bool) -> None:
        """The row's positions from `start` now hold `tokens`, computed `alone` in the pool or not."""
        del self.held[row][start:]
        self.held[row].extend(tokens)
        exact = self.exact[row]
        self.exact[row] = start + len(tokens) if alone and exact >= start else min(exact, start)

    def _restore(self, row: int, state: State) -> bool:
        """A sequence state (`_state`'s) into the row's sequence."""
        if not state.size:
            return False
        buffer = (ctypes.c_ubyte * len(state)).from_buffer(state)
        return native.llama_state_seq_set_data(self._context, buffer, len(state), row) == len(state)

    def _state(self, row: int) -> State:
        """The row's sequence state as llama.cpp saves it (its cells' keys and values); empty if it cannot. The buffer
        is not zeroed (prompt_cache.State): llama.cpp writes it, with the GIL released."""
        size = native.llama_state_seq_get_size(self._context, row)
        state = np.empty(size, dtype=np.uint8)
        buffer = (ctypes.c_ubyte * size).from_buffer(state)
        ok = native.llama_state_seq_get_data(self._context, buffer, size, row) == size
        return state if ok else state[:0]
