"""Bad input through the offline API and the CLI: one clear error each, and the engine keeps serving."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import hf_greedy, prompts
from typer.testing import CliRunner

from mvllm import LLM, SamplingParams
from mvllm.cli import app
from mvllm.engine.engine import Engine, EngineConfig
from mvllm.errors import InvalidRequestError, ModelNotFoundError, PromptTooLongError, UnsupportedModelError

GOOD = prompts(40, [9])[0]


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny("llama")[0]), dtype="float32", num_blocks=64, max_model_len=48)


@pytest.fixture(scope="module")
def want(tiny):
    return hf_greedy(tiny("llama")[1], GOOD, 6)


def good(llm) -> list[int]:
    return llm.generate(GOOD, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("kw, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_tokens=9, max_tokens=4), "min_tokens"),
    (dict(seed="seven"), "seed"),
])
def test_bad_sampling_params(kw, param):
    with pytest.raises(InvalidRequestError, match=param) as e:
        SamplingParams(**kw)
    assert e.value.param == param


@pytest.mark.parametrize("prompt, error, says", [
    ([[]], InvalidRequestError, "the prompt is empty"),
    ([list(range(1, 49))], PromptTooLongError, "48 tokens but this model's context is 48"),
    ("a text prompt", InvalidRequestError, "has no tokenizer"),
    ([[1, 2, 256]], InvalidRequestError, "outside the vocabulary"),
    ([[1, -1]], InvalidRequestError, "outside the vocabulary"),
    ([[1, 2.0]], InvalidRequestError, "integer token ids"),
    (7, InvalidRequestError, "prompts must be"),
])
def test_bad_prompts_then_the_engine_serves_on(llm, want, prompt, error, says):
    with pytest.raises(error, match=says):
        llm.generate(prompt, SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    assert good(llm) == want


def test_stop_strings_need_a_tokenizer(llm, want):
    with pytest.raises(InvalidRequestError, match="stop strings"):
        llm.generate(GOOD, SamplingParams(max_tokens=4, stop=["x"]))
    with pytest.raises(InvalidRequestError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert good(llm) == want


def test_one_bad_prompt_in_a_batch_starts_nothing(llm, want):
    with pytest.raises(PromptTooLongError):
        llm.generate([GOOD, list(range(60))], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    assert good(llm) == want


def test_bad_request_beside_running_ones(llm, want):
    eng = llm.engine
    seq = eng.add_request(GOOD, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    eng.step()
    for bad in ([], list(range(100))):
        with pytest.raises(InvalidRequestError):
            eng.add_request(bad, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request(GOOD, SamplingParams(max_tokens=4), request_id=seq.request_id)
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == want


@pytest.mark.parametrize("kw, says", [
    (dict(dtype="float33"), "dtype must be one of"),
    (dict(device="tpu"), "unknown device"),
    (dict(device="cuda:x"), "unknown device"),
    (dict(num_blocks=0), "num_blocks must be at least 1"),
    (dict(kv_cache_gb=-1.0), "kv_cache_gb must be positive"),
    (dict(max_active=0), "max_active must be at least 1"),
    (dict(max_model_len=1), "max_model_len must be at least 2"),
])
def test_bad_engine_config(kw, says):
    with pytest.raises(InvalidRequestError, match=says):
        Engine(EngineConfig("synthetic:tiny-llama", **kw))


def test_text_model_rejects_empty_text_and_honours_stop_strings(smollm2):
    with pytest.raises(InvalidRequestError, match="empty"):
        smollm2.generate("", SamplingParams(max_tokens=4))
    params = SamplingParams(max_tokens=24, temperature=0.0)
    full = smollm2.generate("Count: 1, 2, 3,", params)[0]
    assert " 5," in full.text
    cut = smollm2.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=24, temperature=0.0, stop=[" 5,"]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(" 5,")]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
    assert smollm2.engine.blocks.num_free == smollm2.engine.blocks.num_blocks


# --- the CLI: one line on stderr, exit code 2, no traceback ---------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "empty").mkdir()
    (root / "gpt2").mkdir()
    (root / "gpt2" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    return root


def cli_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, ["generate", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("args, says", [
    (["hi", "--model", "no-such-model"], "is not a directory"),
    (["hi", "--model", "/no/such/file.gguf"], "does not exist"),
    (["hi", "--model", "{root}/empty"], "has no config.json"),
    (["hi", "--model", "{root}/gpt2"], "'GPT2LMHeadModel'] is not supported; mvllm runs"),
    (["1,2", "--model", "synthetic:tiny-llama", "--max-tokens", "0"], "max_tokens must be at least 1"),
    (["1,2", "--model", "synthetic:tiny-llama", "--temperature", "-1"], "temperature must be >= 0"),
    (["hello there", "--model", "synthetic:tiny-llama"], "has no tokenizer"),
    ([",".join(["7"] * 2100), "--model", "synthetic:tiny-llama"], "context is 2048"),
    (["", "--model", "synthetic:tiny-llama"], "the prompt is empty"),
    (["1,2", "--model", "synthetic:tiny-llama", "--dtype", "float33"], "dtype must be one of"),
    (["1,2", "--model", "synthetic:tiny-llama", "--device", "tpu"], "unknown device"),
])
def test_cli_bad_input(dirs, args, says):
    line = cli_error([a.replace("{root}", str(dirs)) for a in args])
    assert says in line


def test_cli_generates_token_ids_for_a_synthetic_model():
    result = CliRunner().invoke(app, ["generate", "1,2,3", "--model", "synthetic:tiny-llama", "--max-tokens", "3"])
    assert result.exit_code == 0, result.output
    ids = [int(t) for t in result.stdout.strip().strip("[]").split(",")]
    assert len(ids) == 3 and all(0 <= t < 512 for t in ids)
    assert "3 prompt tokens, 3 generated" in result.stderr


def test_cli_error_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "mvllm.cli", "generate", "hi", "--model", "no-such-model"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "no-such-model" in proc.stderr
    assert proc.stdout == ""


def test_api_errors_are_typed():
    with pytest.raises(ModelNotFoundError):
        LLM("no-such-model")
    assert issubclass(PromptTooLongError, InvalidRequestError) and issubclass(InvalidRequestError, ValueError)
    assert UnsupportedModelError.__mro__[1].__name__ == "MvllmError"


def test_max_tokens_beyond_the_context_is_a_typed_error(llm):
    from mvllm.errors import ContextLengthError

    with pytest.raises(ContextLengthError, match="maximum context length is 48 tokens.*requested 49 tokens"):
        llm.generate(GOOD, SamplingParams(max_tokens=40))
    assert len(llm.generate(GOOD, SamplingParams(max_tokens=39, ignore_eos=True))[0].token_ids) == 39
    with pytest.raises(InvalidRequestError, match="seed must fit in 64 bits"):
        SamplingParams(seed=2**70)
