"""What each local worker has in its prefix cache, kept in the server from the KV events the workers send
(as vLLM's KV events feed Dynamo's KV router), so that a routing decision asks no worker anything.

It answers what each worker's `BlockManager.cached_prefix_len` would, exactly, as of the last events applied:
a block is found by its hash (block_hashes, as the workers') and then its tokens are
compared, as `_match` does against hash collisions.

One index serves every worker so that a look-up hashes and compares the prompt's blocks once, not once per
worker: a block's tokens are kept once for all its holders, and each worker's answer is then a run of
hash look-ups. A worker holding a hash with other tokens than another one (a collision) makes look-ups take
the exact path, worker by worker, until no worker holds that hash.
"""

from __future__ import annotations

from itertools import islice, takewhile

from mvllm.engine.block_manager import BLOCK_SIZE, ROOT, block_hashes

Tokens = tuple[int, ...]


class PrefixIndex:
    def __init__(self, block_size: int = BLOCK_SIZE):
        self.block_size = block_size
        self.held: dict[str, dict[int, Tokens]] = {}  # worker -> its cached blocks: hash -> tokens
        self.tokens: dict[int, Tokens] = {}  # hash -> the tokens of its first holder
        self.holders: dict[int, int] = {}  # hash -> how many workers hold it
        self.clashes: set[int] = set()  # hashes some worker holds with other tokens than `tokens` has

    def apply(self, worker: str, stored: list[tuple[int, Tokens]], removed: list[int]) -> None:
        """BlockManager.take_events of `worker`: a hash is in one list at most."""
        held = self.held.setdefault(worker, {})
        for h in removed:
            if held.pop(h, None) is not None:
                self._release(h)
        for h, tokens in stored:
            if held.pop(h, None) is not None:
                self._release(h)
            held[h] = self._hold(h, tokens)

    def drop(self, worker: str) -> None:
        """The worker ended: none of its blocks are cached any more (a new one starts empty)."""
        for h in self.held.pop(worker, {}):
            self._release(h)

    def _hold(self, h: int, tokens: Tokens) -> Tokens:
        n = self.holders.get(h, 0)
        self.holders[h] = n + 1
        if n == 0:
            self.tokens[h] = tokens
            return tokens
        if self.tokens[h] == tokens:
            return self.tokens[h]  # one copy for all holders
        self.clashes.add(h)
        return tokens

    def _release(self, h: int) -> None:
        """One holder less (already out of its `held`)."""
        n = self.holders[h] - 1
        if n == 0:
            del self.holders[h], self.tokens[h]
            self.clashes.discard(h)
            return
        self.holders[h] = n
        if h in self.clashes:  # the holders left may agree again
            left = [held[h] for held in self.held.values() if h in held]
            if all(t == left[0] for t in left):
                self.tokens[h] = left[0]
                self.clashes.discard(h)

    def cached_prefix_len(self, token_ids: list[int], hashes: list[int] | None = None) -> dict[str, int]:
        """Tokens of this prompt each worker's cache would serve now (a worker with no event yet: absent).
        `hashes`: block_hashes(token_ids) where the caller has them; else only the blocks needed
        are hashed."""
        if self.clashes:
            return {w: self._exact(held, token_ids) for w, held in self.held.items()}
        found = self._found(token_ids, hashes)
        bs = self.block_size
        return {w: len(list(takewhile(held.__contains__, found))) * bs for w, held in self.held.items()}

    def _found(self, token_ids: list[int], hashes: list[int] | None) -> list[int]:
        """The hashes of the prompt's leading blocks that some worker holds with the same tokens (the last
        token is always left to compute, as in _match)."""
        out: list[int] = []
        if not self.tokens:
            return out
        get, append = self.tokens.get, out.append
        blocks = islice(zip(*[iter(token_ids)] * self.block_size), max(len(token_ids) - 1, 0) // self.block_size)
        if hashes is not None:
            for block, h in zip(blocks, hashes):
                if get(h) != block:
                    break
                append(h)
            return out
        h = ROOT
        for block in blocks:
            h = hash((h, block))  # block_manager.chain_hash, inlined
            if get(h) != block:
                break
            append(h)
        return out

    def _exact(self, held: dict[int, Tokens], token_ids: list[int]) -> int:
        """One worker's answer, block by block against its own tokens: BlockManager._match."""
        bs, n = self.block_size, 0
        for h in block_hashes(token_ids, bs, tokens=len(token_ids) - 1):
            if held.get(h) != tuple(token_ids[n * bs:(n + 1) * bs]):
                break
            n += 1
        return n * bs
