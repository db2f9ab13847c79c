"""A backend's sizes where the user sets none: its KV pool, how many requests it runs at once (max_active), and how
many tokens one step computes (max_step_tokens).

The pool is num_blocks, else kv_cache_gb (DEFAULT_KV_GB) of KV, at most twice what max_active sequences of the
model's full length need. On CUDA an unset max_active is what that pool holds, as vLLM's max_num_seqs (256)
is a default a GPU fills; the CPU and MPS run MAX_ACTIVE."""

from __future__ import annotations

from mvllm.errors import InvalidRequestError

MAX_ACTIVE = 4  # CPU and MPS
MOST_ACTIVE = 256  # CUDA's cap, vLLM's default max_num_seqs
SEQ_TOKENS = 1024  # a typical request's KV: the reference's 516-token prompt and a few hundred tokens out
DEFAULT_KV_GB = {"cpu": 1.0, "cuda": 4.0, "mps": 1.0}
# A step's token budget: vLLM's OpenAI server's max_num_batched_tokens on CUDA (8,192 on a GPU of 70 GiB or more,
# 2,048 below); on the CPU and MPS the smallest budget whose 1,024-token prompt reaches its first token within 10%
# of its time whole (results/serving-engine: 1.10x at 256 on a Xeon; docs/backends.md).
STEP_TOKENS_BIG_GPU, STEP_TOKENS_GPU, BIG_GPU_GIB = 8192, 2048, 70
STEP_TOKENS_HOST = 256


def pool_blocks(kv_gb: float, block_bytes: int, seq_blocks: int, max_active: int) -> int:
    """The blocks of a kv_gb budget, at most twice what max_active sequences of seq_blocks blocks need."""
    return max(min(int(kv_gb * 2**30 // block_bytes), max_active * seq_blocks * 2), 1)


def default_max_active(device_type: str, num_blocks: int, block_size: int, max_model_len: int) -> tuple[int, str]:
    """(max_active, why) where none is set. CUDA: num_blocks // blocks of min(SEQ_TOKENS, max_model_len) tokens,
    from 1 to MOST_ACTIVE."""
    if device_type != "cuda":
        return MAX_ACTIVE, "measured default" if device_type == "cpu" else "the CPU's default"
    seq = min(SEQ_TOKENS, max_model_len)
    held = num_blocks // -(-seq // block_size)
    why = f"KV holds {held:,} sequence{'' if held == 1 else 's'} of {seq:,} tokens"
    if held > MOST_ACTIVE:
        why += f"; capped at {MOST_ACTIVE}"
    elif held < 1:
        why += "; at least 1"
    return max(1, min(held, MOST_ACTIVE)), why


def default_step_tokens(device_type: str, gpu_gib: float = 0.0) -> tuple[int, str]:
    """(max_step_tokens, why) where none is set: CUDA by its memory (gpu_gib), as vLLM's server; else STEP_TOKENS_HOST."""
    if device_type == "cuda":
        if gpu_gib >= BIG_GPU_GIB:
            return STEP_TOKENS_BIG_GPU, f"a GPU of {gpu_gib:.0f} GiB (vLLM's default from {BIG_GPU_GIB} GiB)"
        return STEP_TOKENS_GPU, f"a GPU of {gpu_gib:.0f} GiB (vLLM's default below {BIG_GPU_GIB} GiB)"
    return STEP_TOKENS_HOST, "measured default"


def check_step_tokens(max_step_tokens: int | None, max_active: int | None) -> None:
    """A budget is at least 1 token, and holds a decode of every running request (max_active)."""
    if max_step_tokens is None:
        return
    if max_step_tokens < 1:
        raise InvalidRequestError(f"max_step_tokens must be at least 1, got {max_step_tokens}", "max_step_tokens")
    if max_active is not None and max_step_tokens < max_active:
        raise InvalidRequestError(f"max_step_tokens={max_step_tokens} is below max_active={max_active}: a step must "
                                  "hold a decode of every running request", "max_step_tokens")
