"""The KV blocks of each sequence, as vLLM v1's KVCacheManager keeps them for its scheduler: a sequence's positions
backed by blocks of the pool (engine/scheduling/kv_blocks.py), taken, shortened and given back; its computed full
blocks registered in the prefix cache, and a new sequence's longest cached prefix found there.

A model's sliding layers may keep their keys and values in a pool of their own (KvGeometry.window_blocks), as vLLM's
hybrid KV cache manager does: there each sequence holds a second table (`window_table`) with the blocks of its last
positions only. Before each of its steps, the blocks wholly before the window of its first position whose step the
host has not taken (`cached`) go back to that pool (prefix-cache blocks staying registered until reused). The pool
holds every row's window and a round's prompt chunks (rows.window_blocks_for), so only the main pool limits what
runs. A cached prefix is taken only as far as the pool of windows still holds the blocks of its window
(BlockPool.match_window): the prefix's sliding layers need those and no earlier ones.

In deterministic mode (batch invariance) the prefix cache serves and keeps only prompt blocks inside whole chunks of
`prefill_chunk` tokens, which any request computes alike.
"""

import math

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.plan import Sequence
from rbee_worker.engine.runners.protocol import KvGeometry
from rbee_worker.engine.scheduling.kv_blocks import BlockPool


class KvManager:
    """The block pool (`blocks`) and the sliding layers' pool of windows (`windows`, where the model has one), as the
    sequences hold them."""

    def __init__(self, config: EngineConfig, kv: KvGeometry) -> None:
        self.deterministic, self.prefill_chunk = config.deterministic, config.prefill_chunk
        self.blocks = BlockPool(kv.blocks, kv.block_size, config.prefix_caching and kv.shared_blocks)
        self.window = kv.window or 0
        self.windows = (
            BlockPool(kv.window_blocks, kv.block_size, config.prefix_caching and kv.shared_blocks)
            if kv.window_blocks
            else None
        )

    def held_tokens(self, sequence: Sequence) -> int:
        """The most positions the sequence's blocks and the pool's free ones hold."""
        return (len(sequence.table.blocks) + self.blocks.free_blocks) * self.blocks.block_size

    def grow(self, sequence: Sequence, tokens: int) -> bool:
        """Blocks for the sequence's positions 0..tokens-1 (in the pool of windows, for its positions from the window
        of its first position whose step the host has not taken, `cached`, the blocks before going back); False
        when a pool has too few."""
        if not self.blocks.grow(sequence.table, tokens):
            return False
        if self.windows is not None:
            first = max(sequence.cached - self.window + 1, 0)
            self.windows.drop(sequence.window_table, first // self.windows.block_size)
            return self.windows.grow(sequence.window_table, tokens)
        return True

    def shorten(self, sequence: Sequence, tokens: int) -> None:
        """The sequence keeps the blocks of its first `tokens` positions (in the pool of windows, of those of them it
        holds)."""
        self.blocks.shorten(sequence.table, tokens)
        if self.windows is not None:
            self.windows.shorten(sequence.window_table, tokens)

    def release(self, sequence: Sequence) -> None:
        """Every block of the sequence goes back (its registered ones stay in the prefix cache until reused)."""
        self.blocks.release(sequence.table)
        if self.windows is not None:
            self.windows.release(sequence.window_table)

    def match(self, sequence: Sequence, limit: int) -> int:
        """The sequence's longest prefix of at most `limit` prompt tokens in whole cached blocks (and in deterministic
        mode whole chunks, which the pool evicts last block first), taken into its tables; how many tokens."""
        tokens = sequence.token_ids(0, sequence.prefill_end)
        found = self.blocks.match(sequence.table, tokens, limit)
        multiple = math.lcm(self.prefill_chunk, self.blocks.block_size) if self.deterministic else 1
        if self.windows is not None and found:  # as long a prefix as the sliding layers' pool holds the window of
            found = self.windows.match_window(sequence.window_table, tokens, found, self.window, multiple)
        found -= found % multiple
        self.blocks.shorten(sequence.table, found)
        return found

    def register(self, sequence: Sequence) -> None:
        """The sequence's computed full blocks join the prefix cache (in deterministic mode its prompt blocks inside
        whole chunks only)."""
        if not self.blocks.prefix_caching:
            return
        computed = sequence.cached
        if self.deterministic:
            prompt = len(sequence.request.prompt_ids)
            computed = min(computed, prompt - prompt % self.prefill_chunk)
        for pool, table in ((self.blocks, sequence.table), (self.windows, sequence.window_table)):
            if pool is None:
                continue
            first = len(table.keys) * pool.block_size  # the first position of a block without a key
            if computed >= first + pool.block_size:
                pool.register(table, sequence.token_ids(first, computed))
