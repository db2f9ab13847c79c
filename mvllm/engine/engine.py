"""One backend's engine: a model on one device, its scheduler, KV blocks and runner. Synchronous;
the caller drives it with `step()` (the offline LLM loops, a backend worker process serves)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mvllm import machine
from mvllm.engine.block_manager import BLOCK_SIZE, BlockManager
from mvllm.engine.model_runner import Launched, ModelRunner
from mvllm.engine.params import SamplingParams, check_prompt
from mvllm.engine.quant import BATCH_INVARIANT, cpu_mode, quantize
from mvllm.engine.scheduler import Batch, Scheduler
from mvllm.engine.sequence import PENDING, Sequence, Status
from mvllm.engine.sizes import (
    DEFAULT_KV_GB,
    MAX_ACTIVE,
    MOST_ACTIVE,
    check_step_tokens,
    default_max_active,
    default_step_tokens,
    pool_blocks,
)
from mvllm.errors import InvalidRequestError
from mvllm.model.loader import ModelSource, build_model, resolve

DEFAULT_DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16, "mps": torch.float16}
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str | None = None
    max_active: int | None = None  # None: engine/sizes.py's default for the device, resolved by Engine
    max_step_tokens: int | None = None  # a step's token budget; None: engine/sizes.py's default, resolved by Engine
    block_size: int = BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_gb: float | None = None
    max_model_len: int | None = None
    threads: int | None = None
    quant: str | None = None  # None: on the CPU, the mode cpu_mode picks for this machine; elsewhere none
    graphs: bool = True
    compile: bool = True  # CUDA: torch.compile + Triton attention where Triton exists (off: eager ops)
    overlap: bool | None = None  # schedule step N+1 while step N runs (its tokens read a step later); None: CUDA
    fused: bool = True  # CPU float32: mvllm's fused kernels where they build (off: plain PyTorch ops)
    batch_invariant: bool | None = None  # CPU int8w: None = quant.BATCH_INVARIANT (engine/quant.py)
    picked: str = ""  # how the CPU mode was chosen

    def validate(self) -> None:
        if self.max_active is not None and self.max_active < 1:
            raise InvalidRequestError(f"max_active must be at least 1, got {self.max_active}", "max_active")
        if self.threads is not None and self.threads < 1:
            raise InvalidRequestError(f"threads must be at least 1, got {self.threads}", "threads")
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be at least 1, got {self.block_size}", "block_size")
        check_step_tokens(self.max_step_tokens, self.max_active)
        for name, least in (("num_blocks", 1), ("max_model_len", 2)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise InvalidRequestError(f"{name} must be at least {least}, got {value}", name)
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise InvalidRequestError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}", "kv_cache_gb")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}", "dtype")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise InvalidRequestError(f"unknown device {self.device!r}; use cpu, cuda or mps", "device") from None
        device_type = device.type
        if device_type not in DEFAULT_DTYPES:
            raise InvalidRequestError(f"unknown device {self.device!r}; use cpu, cuda or mps", "device")
        if device_type == "cpu" and self.threads is not None and self.threads > machine.logical_cpus():
            raise InvalidRequestError(f"threads={self.threads} is more than the {machine.logical_cpus()} CPUs this "
                                      "process may run on (oversubscribed threads slow every step)", "threads")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise InvalidRequestError("device cuda was asked for but this machine has no CUDA GPU", "device")
        if device_type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise InvalidRequestError(f"device {self.device} does not exist; this machine has "
                                      f"{torch.cuda.device_count()} CUDA GPU(s)", "device")
        if device_type == "mps" and not torch.backends.mps.is_available():
            raise InvalidRequestError("device mps was asked for but this machine has no MPS GPU", "device")
        if self.overlap is None:  # on where the device runs apart from the host (as vLLM's async scheduling)
            self.overlap = device_type == "cuda"
        if device_type == "cpu":
            self.dtype, self.quant, self.picked = cpu_mode(self.dtype, self.quant)
        elif self.quant in (None, "none"):
            self.quant = "none"
        else:
            raise InvalidRequestError(f"quant={self.quant} runs on the cpu device only", "quant")
        if self.batch_invariant and self.quant != "int8w":
            raise InvalidRequestError(f"batch_invariant=on is a setting of quant=int8w (this backend runs "
                                      f"quant={self.quant})", "batch_invariant")
        if self.quant == "int8w" and self.batch_invariant is None:
            self.batch_invariant = BATCH_INVARIANT


def step_tokens(config: EngineConfig, max_active: int | None = None) -> tuple[int, str]:
    """(max_step_tokens, why) of a validated config: its own, else the device's default (engine/sizes.py) raised to
    `max_active` where that is more (a default never refuses: it holds a decode of every running request)."""
    if config.max_step_tokens is not None:
        return config.max_step_tokens, "set"
    device = torch.device(config.device)
    gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
    budget, why = default_step_tokens(device.type, gib)
    return max(budget, max_active or 1), why


def context_len(config: EngineConfig, model_cfg, num_blocks: int) -> int:
    return min(config.max_model_len or model_cfg.max_position, model_cfg.max_position, num_blocks * config.block_size)


def served_pool(config: EngineConfig, model_cfg) -> tuple[int, int, str]:
    """(num_blocks, max_active, why that max_active) of a validated config: its KV pool (engine/sizes.py), and
    its own max_active, else the device's default for that pool. Counted, nothing allocated."""
    device_type = torch.device(config.device).type
    dtype = getattr(torch, config.dtype) if config.dtype else DEFAULT_DTYPES[device_type]
    num_blocks = config.num_blocks
    if num_blocks is None:
        most = config.max_active or (MOST_ACTIVE if device_type == "cuda" else MAX_ACTIVE)
        num_blocks = pool_blocks(config.kv_cache_gb or DEFAULT_KV_GB[device_type],
                                 ModelRunner.kv_bytes_per_token(model_cfg, dtype) * config.block_size,
                                 -(-model_cfg.max_position // config.block_size), most)
    if config.max_active is not None:
        return num_blocks, config.max_active, "set"
    return num_blocks, *default_max_active(device_type, num_blocks, config.block_size,
                                           context_len(config, model_cfg, num_blocks))


@dataclass(slots=True)
class StepOutput:
    """A token of a request, or (`error` set) the end of a request whose step failed: its forward, its
    sampling or the check of its token. Such a request is finished (finish_reason "error", its blocks
    freed) and reports no token (token is PENDING); the other requests of its step go on."""
    seq: Sequence
    token: int
    finished: bool
    error: Exception | None = None


class Engine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None):
        config.validate()
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype) if config.dtype else DEFAULT_DTYPES[self.device.type]
        threads = config.threads
        if threads is None and self.device.type == "cpu" and machine.apple_silicon():
            threads = machine.compute_cores()[0]  # torch's default counts the efficiency cores too
        if threads:  # a GPU worker too: serve gives it one thread, as profile measured it
            torch.set_num_threads(threads)
        self.source = source or resolve(config.model)
        cfg = self.source.config
        self.model = quantize(build_model(self.source, self.device, self.dtype), config.quant, self.device,
                              config.batch_invariant)
        if self.device.type == "cpu":
            machine.keep_freed_memory()  # a step's activations reuse freed pages: no page faults each op
        num_blocks, config.max_active, self.max_active_why = served_pool(config, cfg)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.max_model_len = context_len(config, cfg, num_blocks)
        config.max_step_tokens, self.max_step_tokens_why = step_tokens(config, config.max_active)
        check_step_tokens(config.max_step_tokens, config.max_active)
        self.scheduler = Scheduler(self.blocks, config.max_active, self.max_model_len, cfg.eos_token_ids,
                                   config.max_step_tokens)
        self.runner = ModelRunner(self.model, self.device, self.dtype, num_blocks, config.block_size,
                                  config.graphs, config.max_active, self.max_model_len, config.fused,
                                  config.compile)
        self.requests: dict[str, Sequence] = {}
        self.inflight: Launched | None = None  # overlap: the step launched last, its ids not yet read
        self.on_schedule: Callable[[Batch], None] | None = None

    def check_prompt(self, token_ids: list[int]) -> None:
        check_prompt(token_ids, self.source.config.vocab_size, self.max_model_len)

    def add_request(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    arrival: float | None = None) -> Sequence:
        params.validate()
        self.check_prompt(token_ids)
        seq = Sequence(token_ids, params, request_id, arrival)
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use", "request_id")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        self.requests.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        f = self.inflight  # overlap: a launched step holding only ended requests needs no more steps
        return self.scheduler.has_work() or (f is not None and any(s.status is not Status.FINISHED
                                                                    for s in f.batch.seqs))

    def step(self) -> list[StepOutput]:
        """Schedule and run one step; returns its tokens. With `overlap`, the step is launched and the tokens
        returned are the previous step's: the host schedules and packs step N+1 while the device runs step N.
        A step that fails ends only the requests it must, each with an output whose `error` is set: those
        whose sampling or stop check raised, or every request of the batch if its forward did."""
        if self.config.overlap:
            return self._step_overlap()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.on_schedule:
            self.on_schedule(batch)
        try:
            tokens = self.runner.run(batch).tolist()
        except Exception as e:  # the forward failed: this batch's requests end with it
            return self._fail(batch.seqs, e)
        errors = dict(self.runner.failed)  # requests whose sampling failed: they end, the others go on
        sampled = batch.sampled
        finished = self.scheduler.postprocess(batch, tokens, time.time(), errors)
        return self._outputs(sampled, tokens, finished, sampled, errors)

    def _step_overlap(self) -> list[StepOutput]:
        prev, self.inflight = self.inflight, None
        failed = []
        batch = self.scheduler.schedule()
        if batch:
            if self.on_schedule:
                self.on_schedule(batch)
            try:
                self.inflight = self.runner.launch(batch, prev)
            except Exception as e:  # its forward failed: this batch's requests end with it
                failed = self._fail(batch.seqs, e)
            else:
                self.scheduler.launched(batch)
        if prev is None:
            return failed
        live = [s for s in prev.seqs if s.status is not Status.FINISHED]
        try:
            tokens = prev.tokens()
        except Exception as e:  # the step's ids never came: its requests end with it
            return failed + self._fail(live, e)
        errors = dict(prev.failed)
        finished = self.scheduler.land(prev.seqs, prev.index, tokens, time.time(), errors)
        return failed + self._outputs(prev.seqs, tokens, finished, live, errors)

    def _fail(self, seqs: list[Sequence], error: Exception) -> list[StepOutput]:
        """End the requests of a step that failed as a whole (those not ended already)."""
        now, outs = time.time(), []
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.fail(seq, now)
                self.requests.pop(seq.request_id, None)
                outs.append(StepOutput(seq, PENDING, True, error))
        return outs

    def _outputs(self, sampled: list[Sequence], tokens: list[int], finished: list[Sequence],
                 live: list[Sequence], errors: dict[str, Exception]) -> list[StepOutput]:
        done = {s.request_id for s in finished}
        for rid in done:
            self.requests.pop(rid, None)
        keep, outs = {id(s) for s in live}, []
        for s, t in zip(sampled, tokens):
            if id(s) in keep:
                error = errors.get(s.request_id) if s.finish_reason == "error" else None
                outs.append(StepOutput(s, t if error is None else PENDING, s.request_id in done, error))
        return outs

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        return self.blocks.cached_prefix_len(token_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False (nothing changed) while requests are in flight."""
        return not self.has_unfinished() and self.blocks.reset_prefix_cache()

    def warm(self, token_ids: list[int]) -> int:
        """Compute and cache the KV of a prefix (its full blocks) in steps of at most max_step_tokens, as a
        prompt's chunks run; returns the tokens now cached."""
        seq = Sequence(token_ids, SamplingParams(max_tokens=1))
        self.check_prompt(token_ids)
        if not self.blocks.can_allocate(seq):
            raise InvalidRequestError("not enough free KV blocks to warm this prefix now", "prompt")
        self.blocks.allocate(seq)
        try:
            budget = self.config.max_step_tokens
            for start in range(seq.num_computed_tokens, len(seq), budget):
                end = min(start + budget, len(seq))
                batch = Batch()
                batch.add_chunk(seq, start, end)
                self.runner.run(batch.seal())
                seq.num_computed_tokens = end
                self.blocks.commit(seq)
        finally:
            self.blocks.free(seq)
        return len(token_ids) // self.blocks.block_size * self.blocks.block_size
