"""A backend's KV blocks as the simulator models them: engine/block_manager.py's pool counted, not stored.

A block is referenced (pinned by the running requests that hold it), free and clean, or free and cached
(its hash kept, evicted least recently released first when an allocation needs room). Only the hashes of
the cached blocks are kept (`refs`: hash -> the running requests that hold that block), and a request's
block table is a list of hashes (None for a block not published: a partial block, or one whose hash
another block holds already). `num_blocks` None is a pool without bound (a profile without kv_blocks):
nothing is evicted and every allocation fits. A trace's prompt left as its hash ids has keys in place of the
hashes (bench/idprompt.py: equal exactly where the hashes are), so the same blocks hit and are evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice

from mvllm.engine.block_manager import BLOCK_SIZE, ROOT


def chain(tokens: list[int], start: int = 0, parent: int = ROOT) -> list[int]:
    """block_manager.block_hashes over the full blocks of `tokens` from block `start` on (the chain's hash
    before it: `parent`), as a list; the same values, without a generator's and a call's cost per block."""
    out, h, bs, t = [], parent, BLOCK_SIZE, tuple(tokens)
    for i in range(start * bs, len(t) // bs * bs, bs):
        h = hash((h, t[i:i + bs]))
        out.append(h)
    return out


def stand_ins(hashes: list[int], key: object, end: int) -> list[int]:
    """The chain `hashes` goes on to `end` blocks with hashes of blocks that no prompt holds (`key`: the
    request's): a reply whose tokens nobody sends back needs only to take room in the cache."""
    out, h = [], hashes[-1] if hashes else ROOT
    for i in range(len(hashes), end):
        h = hash((h, ("reply", key, i)))
        out.append(h)
    return out


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


class KVCache:
    def __init__(self, num_blocks: int | None = None):
        self.num_blocks = num_blocks
        self.refs: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # free cached blocks, least recently released first
        self.in_use = 0  # referenced blocks

    @property
    def bounded(self) -> bool:
        return self.num_blocks is not None

    @property
    def free(self) -> int:
        return self.num_blocks - self.in_use

    def hits(self, hashes: list[int], tokens: int) -> int:
        """Cached blocks that a sequence of `tokens` tokens (hashes: its blocks' chain) finds, the last token
        always left to compute (the engine's `_match`); changes nothing."""
        refs, n = self.refs, 0
        for h in islice(hashes, (tokens - 1) // BLOCK_SIZE):
            if h not in refs:
                break
            n += 1
        return n

    def cached_prefix_len(self, hashes: list[int], tokens: int) -> int:
        return self.hits(hashes, tokens) * BLOCK_SIZE

    def can_allocate(self, hashes: list[int], tokens: int, hit: int | None = None) -> bool:
        """The engine's can_allocate; `hit`: hits(hashes, tokens), where the caller has it."""
        if self.num_blocks is None:
            return True
        hit = self.hits(hashes, tokens) if hit is None else hit
        reusable = sum(1 for h in hashes[:hit] if not self.refs[h])
        return blocks_for(tokens) - hit <= self.free - reusable

    def allocate(self, hashes: list[int], tokens: int, hit: int | None = None) -> tuple[list, int]:
        """(the block table of a sequence of `tokens` tokens admitted now, its cached blocks)."""
        hit = self.hits(hashes, tokens) if hit is None else hit
        if self.num_blocks is None:
            return [], hit
        refs, table = self.refs, hashes[:hit]
        for h in table:
            if not refs[h]:
                del self.lru[h]
                self.in_use += 1
            refs[h] += 1
        self._take(blocks_for(tokens) - hit)
        table.extend([None] * (blocks_for(tokens) - hit))
        return table, hit

    def grow(self, table: list, tokens: int) -> bool:
        """Room for the KV of `tokens` tokens in the table (a decode step's append); False: no free block."""
        need = blocks_for(tokens) - len(table)
        if self.num_blocks is None or need <= 0:
            return True
        if need > self.free:
            return False
        self._take(need)
        table.extend([None] * need)
        return True

    def _take(self, n: int) -> None:
        evict = n - (self.num_blocks - self.in_use - len(self.lru))  # beyond the clean blocks
        if evict > 0:
            refs, pop = self.refs, self.lru.popitem
            for _ in range(evict):
                del refs[pop(False)[0]]
        self.in_use += n

    def commit(self, table: list, hashes: list[int], start: int, end: int) -> None:
        """Publish blocks start..end-1 of the table (their KV computed): a block whose hash no block holds yet
        becomes that hash's block; one whose hash is held already stays unpublished."""
        refs, end = self.refs, min(end, len(hashes))
        if self.num_blocks is None:
            for h in hashes[start:end]:
                refs.setdefault(h, 0)
            return
        new = hashes[start:end]  # the table's blocks past those published are unpublished
        if refs.keys().isdisjoint(new):
            table[start:end] = new
            refs.update(dict.fromkeys(new, 1))
            return
        for i, h in enumerate(new, start):
            if h not in refs:
                refs[h] = 1
                table[i] = h

    def release(self, table: list) -> None:
        """Free a table's blocks, its last block first: a published block whose last holder this was is cached
        (the most recently released), the others go back clean."""
        if self.num_blocks is None:
            return
        refs, lru, kept = self.refs, self.lru, 0
        for h in reversed(table):
            if h is not None:
                left = refs[h] - 1
                refs[h] = left
                if left:
                    kept += 1
                else:
                    lru[h] = None
        self.in_use -= len(table) - kept
        table.clear()

    def warm(self, hashes: list[int], tokens: int) -> None:
        """engine.warm: a prefix's full blocks computed, published and freed."""
        table, hit = self.allocate(hashes, tokens)
        self.commit(table, hashes, hit, tokens // BLOCK_SIZE)
        self.release(table)
