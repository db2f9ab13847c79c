"""Paged KV blocks with prefix caching: a hash chain over full blocks, reference counts, LRU eviction."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from mvllm.engine.sequence import Sequence

BLOCK_SIZE = 16  # tokens per KV block: the engine's default, and what the simulator and shadow indexes assume
# The parent of every chain's first block: a constant, so a worker and the server hash a prompt alike
# (hash(None) is an address before Python 3.12, different in each process).
ROOT = 0


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def block_hashes(token_ids: list[int], block_size: int = BLOCK_SIZE, *, tokens: int | None = None,
                 start: int = 0, parent: int = ROOT) -> Iterator[int]:
    """The hash chain over the full blocks among the first `tokens` of `token_ids` (default: all of them),
    lazily, so a look-up can stop at its first miss: hash i stands for block i and every block before it.
    `start`, `parent`: go on with a chain whose first `start` blocks are hashed already, the last to `parent`."""
    end = (len(token_ids) if tokens is None else max(tokens, 0)) // block_size * block_size
    for block in zip(*[iter(token_ids[start * block_size:end])] * block_size):  # the blocks' tuples, made in C
        parent = hash((parent, block))  # chain_hash, inlined
        yield parent


class BlockManager:
    """Blocks are in one of three states: referenced (ref_count > 0), free and clean (no hash), or free
    and cached (hash kept, evictable, in LRU order: least recently released first).

    With `record_events`, each change to the prefix cache (a hash into hash_to_block, or out of it) is noted
    for `take_events`: a worker sends them to the server's index (routing/prefix_index.py)."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.clean: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}
        self.events: dict[int, tuple[int, ...] | None] | None = None  # hash -> its tokens, or None: gone
        self.queries = 0
        self.hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.clean) + len(self.cached_free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match(self, token_ids: list[int]) -> list[int]:
        """Ids of cached blocks holding a prefix of token_ids; the last token is always left to compute."""
        bs, hit = self.block_size, []
        for i, h in enumerate(block_hashes(token_ids, bs, tokens=len(token_ids) - 1)):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            hit.append(block_id)
        return hit

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """Tokens of this prompt that the cache would serve now; changes nothing, LRU order included."""
        return len(self._match(token_ids)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        hit = self._match(seq.token_ids)
        reusable_free = sum(1 for b in hit if self.blocks[b].ref_count == 0)
        return self.blocks_needed(len(seq)) - len(hit) <= self.num_free - reusable_free

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table
        hit = self._match(seq.token_ids)
        self.queries += 1
        self.hits += bool(hit)
        for block_id in hit:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        for _ in range(self.blocks_needed(len(seq)) - len(hit)):
            seq.block_table.append(self._take_free())
        seq.num_computed_tokens = len(hit) * self.block_size

    def _take_free(self) -> int:
        if self.clean:
            block_id = self.clean.popleft()
        else:
            block_id, _ = self.cached_free.popitem(last=False)
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.events is not None:
                    self.events[block.hash] = None
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id

    def can_append(self, seq: Sequence) -> bool:
        return len(seq) <= len(seq.block_table) * self.block_size or self.num_free > 0

    def append(self, seq: Sequence) -> None:
        """Make room for the KV of every token in seq (called before a decode step)."""
        while len(seq) > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take_free())

    def commit(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV has been computed, so later prompts can reuse them."""
        bs, done = self.block_size, len(seq.block_hashes)
        if seq.num_computed_tokens < (done + 1) * bs:
            return  # no block filled since the last commit: a decode's usual step
        new = block_hashes(seq.token_ids, bs, tokens=seq.num_computed_tokens, start=done,
                           parent=seq.block_hashes[-1] if done else ROOT)
        for i, h in enumerate(new, done):
            seq.block_hashes.append(h)
            if h not in self.hash_to_block:
                block = self.blocks[seq.block_table[i]]
                block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self.hash_to_block[h] = block.id
                if self.events is not None:
                    self.events[h] = block.token_ids

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                    self.cached_free[block_id] = None
                else:
                    block.hash, block.token_ids = None, ()
                    self.clean.append(block_id)
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (as vLLM's /reset_prefix_cache); refused while any block is in use."""
        if any(b.ref_count for b in self.blocks):
            return False
        if self.events is not None:
            self.events.update(dict.fromkeys(self.hash_to_block))
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self.hash_to_block.clear()
        self.cached_free.clear()
        self.clean = deque(range(self.num_blocks))
        return True

    def record_events(self) -> None:
        """From now on, note every change to the prefix cache (nothing cached yet)."""
        assert not self.hash_to_block, "record events from an empty cache"
        self.events = {}

    def take_events(self) -> tuple[list[tuple[int, tuple[int, ...]]], list[int]] | None:
        """The changes since the last call, None if there were none: (stored: (hash, tokens) of the blocks
        cached now, removed: the hashes gone). Only a hash's last change is kept, so a hash is in one list
        at most and the two can be applied in any order."""
        if not self.events:
            return None
        stored = [(h, t) for h, t in self.events.items() if t is not None]
        removed = [h for h, t in self.events.items() if t is None]
        self.events = {}
        return stored, removed

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks
