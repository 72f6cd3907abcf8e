"""The KV cache's memory as the scheduler accounts for it: one pool of fixed-size blocks, a block table per sequence,
and the prefix cache (vLLM's design: vllm/v1/core/block_pool.py and kv_cache_manager.py).

A sequence's position p lives in block `table.blocks[p // block_size]` at offset `p % block_size`; its table grows a
block at a time as it grows, and its blocks go back to the pool when it ends or is preempted. Block 0 is never
handed out: it is the scratch block that batch rows without a sequence (padding) write to and read from.

Prefix cache: a full block whose keys and values are computed is registered under a key, the digest of its parent's
key and its own tokens, so a key names the whole prefix up to the block's end. A new sequence takes the blocks of the
longest chain of keys that its tokens give (`match`) and computes only the rest. A block that no sequence holds any
more stays registered, in the free queue, until the pool needs it (least recently freed first). Several sequences may
hold one registered block; none writes it, since a sequence writes only positions past its matched prefix, and a
matched prefix is whole blocks.

A pool of windows (a model's sliding layers' own, KvGeometry.window_blocks) is a BlockPool too, whose tables let go
of their blocks before a sequence's window as it advances (`drop`: their entries become the scratch block), and
whose prefix lookup takes only the blocks of a cached prefix's last window (`match_window`).
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

SCRATCH_BLOCK = 0


@dataclass(eq=False)
class BlockTable:
    """A sequence's blocks, in position order, and the keys of the first `len(keys)` of them (registered, or found).
    In a pool of windows, its first `dropped` entries are the scratch block: positions before its window."""

    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    dropped: int = 0


class BlockPool:
    """`num_blocks` blocks of `block_size` token positions (block 0 the scratch block), their reference counts, the
    registered blocks by key, and the free queue. Runs on the engine thread."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("a block pool needs at least 2 blocks of at least 1 position")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._refs = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        # Blocks nobody holds, the next to hand out first: blocks without a key go to the front, registered ones to
        # the back, so a registered block is reused only when no empty one is left, the least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which found

    @property
    def capacity(self) -> int:
        """Blocks that sequences can hold (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks that no sequence holds (registered or not): what `grow` can hand out."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.capacity - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match(self, table: BlockTable, token_ids: Sequence[int], limit: int) -> int:
        """An empty table takes the registered blocks of the longest cached prefix of `token_ids` (at most `limit`
        tokens, whole blocks); returns the tokens they hold."""
        assert not table.blocks, "only a sequence with no blocks looks up its prefix"
        if not self.prefix_caching:
            return 0
        size, parent = self.block_size, b""
        for start in range(0, limit - size + 1, size):
            key = block_key(parent, token_ids[start : start + size])
            block = self._by_key.get(key)
            if block is None:
                break
            self._hold(block)
            table.blocks.append(block)
            table.keys.append(key)
            parent = key
        return len(table.blocks) * size

    def match_window(
        self, table: BlockTable, token_ids: Sequence[int], found: int, window: int, multiple: int = 1
    ) -> int:
        """In a pool of windows (the sliding layers' own): an empty table takes the registered blocks that the window
        of the longest prefix needs, of at most `found` tokens (whole blocks, and a `multiple` of tokens): the blocks
        of its positions from `prefix - window + 1` on, its entries before them the scratch block; returns the tokens
        of that prefix (0 when no prefix's window is cached whole)."""
        assert not table.blocks, "only a sequence with no blocks looks up its prefix"
        size, parent, keys, present = self.block_size, b"", [], []
        for start in range(0, found - size + 1, size):
            parent = block_key(parent, token_ids[start : start + size])
            keys.append(parent)
            present.append(parent in self._by_key)
        run = 0  # registered blocks in a row, ending at the prefix's last block
        runs = []
        for here in present:
            run = run + 1 if here else 0
            runs.append(run)
        for count in range(len(keys), 0, -1):  # the prefix of `count` blocks, the longest first
            first = max(count * size - window + 1, 0) // size  # its window's first block
            if count * size % multiple == 0 and runs[count - 1] >= count - first:
                blocks = [self._by_key[key] for key in keys[first:count]]
                for block in blocks:
                    self._hold(block)
                table.blocks = [SCRATCH_BLOCK] * first + blocks
                table.keys = keys[:count]
                table.dropped = first
                return count * size
        return 0

    def shorten(self, table: BlockTable, tokens: int) -> None:
        """The table keeps the blocks (and keys) of its first `tokens` positions; the blocks after go back."""
        keep = self.blocks_for(tokens)
        for block in reversed(table.blocks[max(keep, table.dropped) :]):
            self._unhold(block)
        del table.blocks[keep:]
        del table.keys[keep:]

    def drop(self, table: BlockTable, before: int) -> None:
        """The table's blocks before entry `before` (positions before its window) go back to the pool, registered ones
        staying in the prefix cache until reused; their entries become the scratch block."""
        for index in range(table.dropped, min(before, len(table.blocks))):
            self._unhold(table.blocks[index])
            table.blocks[index] = SCRATCH_BLOCK
        table.dropped = max(table.dropped, min(before, len(table.blocks)))

    def count_query(self, tokens: int, hits: int) -> None:
        """A prompt of `tokens` tokens started with `hits` of them found in the prefix cache (the metrics' counts)."""
        self.queried_tokens += tokens
        self.hit_tokens += hits

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Give the table blocks for positions 0..tokens-1; False, and nothing taken, when the pool has too few."""
        needed = self.blocks_for(tokens) - len(table.blocks)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block, _ = self._free.popitem(last=False)
            if (key := self._key[block]) is not None:  # evicted from the prefix cache
                del self._by_key[key]
                self._key[block] = None
            self._refs[block] = 1
            table.blocks.append(block)
        return True

    def register(self, table: BlockTable, token_ids: Sequence[int]) -> None:
        """`token_ids`: the tokens at the table's positions from its first block without a key on, whose keys and
        values are computed. Its full blocks among them join the prefix cache. (Where another sequence registered the
        same prefix first, that block stays the cached one and this table keeps its own copy.)"""
        if not self.prefix_caching:
            return
        size, first = self.block_size, len(table.keys)
        parent = table.keys[-1] if table.keys else b""
        for index in range(first, first + len(token_ids) // size):
            offset = (index - first) * size
            key = block_key(parent, token_ids[offset : offset + size])
            block = table.blocks[index]
            if block == SCRATCH_BLOCK:  # dropped before it was computed whole (a pool of windows): nothing to keep
                return
            if key not in self._by_key:
                self._by_key[key] = block
                self._key[block] = key
            table.keys.append(key)
            parent = key

    def release(self, table: BlockTable) -> None:
        """The sequence lets go of its blocks (ended, or preempted): each that nobody else holds is free, its tail
        first, so that a prefix's last blocks are evicted before its first ones."""
        for block in reversed(table.blocks[table.dropped :]):
            self._unhold(block)
        table.blocks.clear()
        table.keys.clear()
        table.dropped = 0

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _unhold(self, block: int) -> None:
        """One holder less; a block nobody holds is free: at the front of the queue unless the prefix cache has it."""
        self._refs[block] -= 1
        assert self._refs[block] >= 0, f"block {block} released more often than taken"
        if self._refs[block] == 0:
            self._free[block] = None
            if self._key[block] is None or self._by_key.get(self._key[block]) != block:
                self._key[block] = None
                self._free.move_to_end(block, last=False)

    def check(self) -> None:
        """Assert the pool's invariants (tests): every block is free or held, never both, and the registry and the
        blocks' keys agree."""
        held = {b for b in range(1, self.num_blocks) if self._refs[b] > 0}
        assert held.isdisjoint(self._free) and len(held) + len(self._free) == self.capacity
        assert self._refs[SCRATCH_BLOCK] == 0 and SCRATCH_BLOCK not in self._free
        for key, block in self._by_key.items():
            assert self._key[block] == key


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A full block's key: the digest of its parent's key and its tokens (so it stands for the whole prefix)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


MATCH_STRIDE = 64  # tokens compared at once (as tuple slices) while finding a common prefix


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens `a` and `b` share: whole MATCH_STRIDE-long slices first, then token by token."""
    end, n = min(len(a), len(b)), 0
    while n + MATCH_STRIDE <= end and a[n : n + MATCH_STRIDE] == b[n : n + MATCH_STRIDE]:
        n += MATCH_STRIDE
    while n < end and a[n] == b[n]:
        n += 1
    return n
