"""What the router believes a remote server has cached: the hash chain (the engine's `block_hashes`) of
every full block it sent there, least recently used first out once the remote's KV size is reached.

It is an estimate. The remote may have evicted blocks sooner (other clients, a smaller cache), restarted,
or never cache at all; `prompt_tokens_details.cached_tokens` in its responses says what it really found.
"""

from __future__ import annotations

from collections import OrderedDict

from mvllm.engine.block_manager import BLOCK_SIZE, block_hashes


class ShadowIndex:
    def __init__(self, capacity: int, block_size: int = BLOCK_SIZE):
        self.capacity, self.block_size = capacity, block_size
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """As BlockManager's: full blocks found in a row from the start, the last token always left to compute."""
        n = 0
        for h in block_hashes(token_ids, self.block_size, tokens=len(token_ids) - 1):
            if h not in self.blocks:
                break
            n += 1
        return n * self.block_size

    def add(self, token_ids: list[int]) -> None:
        """The remote has computed these tokens: their full blocks are cached there, most recently used (the
        first block last, so that eviction takes a chain from its end and never breaks a prefix)."""
        for h in reversed(list(block_hashes(token_ids, self.block_size))):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def resize(self, capacity: int, block_size: int) -> None:
        if block_size != self.block_size:
            self.blocks.clear()
        self.capacity, self.block_size = capacity, block_size
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()

    def usage(self) -> float:
        return len(self.blocks) / self.capacity if self.capacity else 0.0
