"""One request inside an engine: its tokens, its KV blocks, its timestamps and counters."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from mvllm.engine.params import SamplingParams

_ids = itertools.count()
PENDING = -1  # overlap: a token sampled by a step whose ids have not reached the host yet


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Times:
    """Wall-clock seconds (time.time), comparable across processes."""

    arrival: float = 0.0
    scheduled: float | None = None
    first_token: float | None = None
    tokens: list[float] = field(default_factory=list)
    finished: float | None = None


class Sequence:
    def __init__(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 arrival: float | None = None):
        self.request_id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.early_stop_ids: list[int] = []  # masked from sampling until min_tokens outputs exist
        self.generator = None
        self.times = Times(arrival=arrival if arrival is not None else time.time())

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
