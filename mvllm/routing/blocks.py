"""What the router remembers sending each backend, over token blocks: SGLang's router keeps such a tree per
worker (of text) and routes by it without asking the workers. A block hash stands for its whole prefix (the
engine's hash chain, engine/block_manager.py), so a set of hashes is that tree; the oldest are forgotten past
`capacity` (SGLang's max_tree_size, 2^26 characters, at ~4 characters a token and 16 tokens a block)."""

from __future__ import annotations

from collections import OrderedDict

CAPACITY = 2**26 // 4 // 16


class SentBlocks:
    def __init__(self, capacity: int = CAPACITY):
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, hashes: list[int]) -> int:
        """Leading blocks of the chain sent here before."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()
