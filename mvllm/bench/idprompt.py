"""A Mooncake prompt left as its trace's hash ids, for the simulator: the tokens are never made.

A trace's hash id stands for one fixed block of random tokens (bench/traces.py), so two prompts hold the
same tokens up to the end of block i exactly where their first i + 1 hash ids are the same. `Trie` numbers
each distinct run of first ids (a node per trace block); where the trace block holds a whole number of the
engine's blocks, engine block k of a prompt is keyed by its trace block's node and its place in it, and two
keys are equal exactly where block_hashes' chain values are (both stand for the block and every block before
it). The simulator's prefix cache is keyed on these numbers instead of hashes of the tokens: the same hits,
the same evictions.
"""

from __future__ import annotations

from mvllm.engine.block_manager import BLOCK_SIZE


class Trie:
    """Runs of first hash ids, numbered: a prompt's node at block i names its ids up to i."""

    def __init__(self, block: int):
        self.per = block // BLOCK_SIZE  # engine blocks per trace block
        self.nodes: dict[tuple[int, int], int] = {}

    def prompt(self, ids: list[int], n: int) -> IdPrompt:
        nodes, parent, out = self.nodes, -1, []
        for h in ids:
            parent = nodes.setdefault((parent, h), len(nodes))
            out.append(parent)
        return IdPrompt(n, out, self.per)


class IdPrompt:
    """A prompt of `n` tokens whose trace blocks are the trie's `nodes`; len() is its length."""

    __slots__ = ("n", "nodes", "per")

    def __init__(self, n: int, nodes: list[int], per: int):
        self.n, self.nodes, self.per = n, nodes, per

    def __len__(self) -> int:
        return self.n

    def keys(self) -> list[int]:
        """Its full engine blocks' keys, in place of block_hashes' chain."""
        per, out = self.per, []
        for node in self.nodes:
            out += range(node * per, node * per + per)
        del out[self.n // BLOCK_SIZE:]
        return out

    def seen(self, before: dict[int, int]) -> int:
        """How many of its full engine blocks came in prompts before it (`before`: node -> blocks of it seen
        so far, a prefix of the node's; its own noted there): the count of its keys in a set of theirs."""
        left, per, out = self.n // BLOCK_SIZE, self.per, 0
        for node in self.nodes:
            m = min(per, left)
            if m <= 0:
                break
            had = before.get(node, 0)
            out += min(had, m)
            if m > had:
                before[node] = m
            left -= per
        return out
