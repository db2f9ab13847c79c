"""Model specs resolve to the right source or fail with one clear error; configs parse in both layouts."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_greedy, make_tiny, prompts
from safetensors.torch import load_file, save_file

from mvllm import LLM, SamplingParams
from mvllm.errors import ModelNotFoundError, UnsupportedModelError
from mvllm.model.config import ModelConfig
from mvllm.model.loader import resolve


@pytest.mark.parametrize("spec, says", [
    ("no-such-model", "is not a directory, a .gguf file, a hub id"),
    ("synthetic:no-such-preset", "unknown synthetic preset"),
    ("./no/such/dir", "is not a directory"),
    ("/no/such/model.gguf", "does not exist"),
])
def test_unknown_specs(spec, says):
    with pytest.raises(ModelNotFoundError, match=says):
        resolve(spec)


def test_unreachable_hub_id_is_one_line(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while ...")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError, match="could not fetch 'some-org/some-model'") as e:
        resolve("some-org/some-model")
    assert "\n" not in str(e.value) and "Name or service not known" in str(e.value)


def test_missing_and_broken_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        LLM(str(empty))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve(str(tmp_path / "notes.txt"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(UnsupportedModelError, match="as a GGUF model"):
        resolve(str(junk))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        resolve(str(broken))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "llama"
    make_tiny(path, "llama")
    return path


def copy_with(saved, tmp_path, config: dict | None = None, tensors=None):
    out = tmp_path / "model"
    out.mkdir()
    cfg = json.loads((saved / "config.json").read_text())
    cfg.update(config or {})
    (out / "config.json").write_text(json.dumps(cfg))
    state = load_file(saved / "model.safetensors")
    if tensors is not None:
        state = tensors(state)
    if state:
        save_file(state, out / "model.safetensors")
    return out


def test_unsupported_architecture(saved, tmp_path):
    path = copy_with(saved, tmp_path, {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        LLM(str(path))


@pytest.mark.parametrize("config, tensors, error, says", [
    ({}, lambda s: {}, ModelNotFoundError, "no \\*.safetensors"),
    ({"hidden_size": 96}, None, UnsupportedModelError, "do not fit config.json"),
    ({}, lambda s: {k: v for k, v in s.items() if "layers.1.mlp.down" not in k}, UnsupportedModelError,
     "lack model.layers.1.mlp.down_proj.weight"),
    ({}, lambda s: {**s, "model.layers.0.mlp.up_proj.bias": torch.zeros(128)}, UnsupportedModelError,
     "does not use: model.layers.0.mlp.up_proj.bias"),
    ({"mlp_bias": True}, None, UnsupportedModelError, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, None, UnsupportedModelError,
     "rope scaling"),
])
def test_weights_and_config_that_do_not_fit(saved, tmp_path, config, tensors, error, says):
    path = copy_with(saved, tmp_path, config, tensors)
    with pytest.raises(error, match=says):
        LLM(str(path), num_blocks=8)


def test_config_lacking_keys():
    with pytest.raises(UnsupportedModelError, match="lacks hidden_size"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 2})


def test_transformers_4_and_5_config_layouts_agree():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                eos_token_id=[5, 7])
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    v4 = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": scaling})
    v5 = ModelConfig.from_dict({**base, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert v4.rope_theta == v5.rope_theta == 5e5
    assert v4.rope_scaling["factor"] == v5.rope_scaling["factor"] == 8.0
    assert v4.eos_token_ids == [5, 7] and v4.head_dim == 16 and v4.num_kv_heads == 2
    plain = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    qwen = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.max_position == 512
    windowed = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                      "sliding_window": 128})
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 256})
    assert windowed.max_position == 128 and mistral.max_position == 256  # no sliding attention: cap the context


def test_qwen25_preset_has_the_real_shapes():
    c = resolve("synthetic:qwen2.5-0.5b").config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == \
        (24, 896, 14, 2, 4864, 151936)
    assert c.tie_word_embeddings and c.attention_bias and c.architecture == "qwen2"


def test_sharded_checkpoint_and_generation_config_eos(tmp_path):
    ref = make_tiny(tmp_path / "one", "qwen2", seed=3)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    gen = tmp_path / "sharded" / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": [3, 9]}))
    llm = LLM(str(tmp_path / "sharded"), dtype="float32", num_blocks=32)
    assert llm.engine.source.config.eos_token_ids == [3, 9]
    prompt = prompts(30, [13])[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(ref, prompt, 12)
