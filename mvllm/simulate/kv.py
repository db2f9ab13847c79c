"""A backend's KV blocks as the simulator models them: engine/block_manager.py's pool counted, not stored.

A block is referenced (pinned by the running requests that hold it), free and clean, or free and cached
(its hash kept, evicted least recently released first when an allocation needs room). Only the hashes of
the cached blocks are kept (`refs`: hash -> the running requests that hold that block, or for a free one the
mark of the release that freed it), and a request's block table is a list of hashes (None for a block not
published: a partial block, or one whose hash another block holds already). The free cached blocks are listed
in the order they were freed (`order`), each with its release's mark: an entry whose block was taken again
since, or freed again later, no longer matches its mark and is passed over, so a block taken from the cache
costs nothing there, and the oldest ones are evicted in bulk. `num_blocks` None is a pool without bound (a
profile without kv_blocks): nothing is evicted and every allocation fits. A trace's prompt left as its hash
ids has keys in place of the hashes (bench/idprompt.py: equal exactly where the hashes are), so the same
blocks hit and are evicted.
"""

from __future__ import annotations

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
        self.refs: dict[int, int] = {}  # hash -> holders (> 0), or the release mark (< 0) of a free cached block
        self.order: list[int] = []  # free cached blocks' hashes, least recently released first, from `head` on
        self.marks: list[int] = []  # the release mark of each entry of `order`
        self.head = 0
        self.cached = 0  # free cached blocks
        self.releases = 0
        self.in_use = 0  # referenced blocks

    @property
    def bounded(self) -> bool:
        return self.num_blocks is not None

    @property
    def free(self) -> int:
        return self.num_blocks - self.in_use

    @property
    def lru(self) -> list[int]:
        """The free cached blocks' hashes, least recently released first (the next evicted first)."""
        refs, i = self.refs, self.head
        return [h for h, mark in zip(self.order[i:], self.marks[i:]) if refs.get(h) == mark]

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
        reusable = sum(1 for h in hashes[:hit] if self.refs[h] < 0)
        return blocks_for(tokens) - hit <= self.free - reusable

    def allocate(self, hashes: list[int], tokens: int, hit: int | None = None) -> tuple[list, int]:
        """(the block table of a sequence of `tokens` tokens admitted now, its cached blocks)."""
        hit = self.hits(hashes, tokens) if hit is None else hit
        if self.num_blocks is None:
            return [], hit
        refs, table = self.refs, hashes[:hit]
        for h in table:
            if refs[h] < 0:  # free and cached: taken again (its entry in `order` is passed over)
                refs[h] = 1
                self.cached -= 1
                self.in_use += 1
            else:
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
        evict = n - (self.num_blocks - self.in_use - self.cached)  # beyond the clean blocks
        if evict > 0:
            self._evict(evict)
        self.in_use += n

    def _evict(self, n: int) -> None:
        """Forget the n least recently released free cached blocks."""
        refs, order, marks, i = self.refs, self.order, self.marks, self.head
        self.cached -= n
        end = i + n
        if n > 1 and list(map(refs.get, order[i:end])) == marks[i:end]:  # the next n are all still cached
            for h in order[i:end]:
                del refs[h]
            i = end
        else:
            while n:
                h, mark = order[i], marks[i]
                i += 1
                if refs.get(h) == mark:
                    del refs[h]
                    n -= 1
        if i > 4096 and 2 * i > len(order):  # the entries passed are most of the list: drop them
            del order[:i], marks[:i]
            i = 0
        self.head = i

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
            for h in new:  # (a loop: sooner than an update from a dict of them)
                refs[h] = 1
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
        self.releases += 1
        refs, mark, freed, kept = self.refs, -self.releases, [], 0
        for h in reversed(table):
            if h is not None:
                left = refs[h] - 1
                if left:
                    refs[h] = left
                    kept += 1
                else:
                    refs[h] = mark
                    freed.append(h)
        self.order += freed
        self.marks += [mark] * len(freed)
        self.cached += len(freed)
        self.in_use -= len(table) - kept
        table.clear()

    def warm(self, hashes: list[int], tokens: int) -> None:
        """engine.warm: a prefix's full blocks computed, published and freed."""
        table, hit = self.allocate(hashes, tokens)
        self.commit(table, hashes, hit, tokens // BLOCK_SIZE)
        self.release(table)
