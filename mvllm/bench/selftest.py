"""`mvllm bench --selftest`: the load generator's ceiling on this machine, against the stub server.

A burst of `streams` requests of `tokens` tokens each, all sent at once to a stub that streams pre-made chunks
as fast as the sockets take them: what the client reads per second is its ceiling (a server measured below
it is measured, not the client). The stub's processes and the client's split the cores.
"""

from __future__ import annotations

import os

from mvllm.bench.health import summarize_client
from mvllm.bench.loadgen import generate
from mvllm.bench.metrics import summarize
from mvllm.bench.request import Request
from mvllm.bench.stub import MODEL, StubServer


def ceiling(workers: int | None = None, stub_processes: int | None = None, streams: int = 1024,
            tokens: int = 256, on_done=None) -> dict:
    cores = os.cpu_count() or 1
    workers = workers or max(1, cores // 2)
    stub_processes = stub_processes or max(1, cores - workers)
    requests = [Request(i, [1, 2, 3, 4], tokens, 0.0) for i in range(streams)]
    with StubServer(stub_processes) as stub:
        records, duration, _, health = generate(stub.url, MODEL, requests, 60.0, workers, on_done)
    s = summarize(records, duration)
    chunks = sum(len(r.chunks) for r in records if r.ok)
    return {"cores": cores, "client_workers": workers, "stub_processes": stub_processes, "streams": streams,
            "tokens": tokens, "completed": s["completed"], "failed": s["failed"], "duration": duration,
            "output_throughput": s["output_throughput"], "chunks_per_s": chunks / duration if duration else None,
            "client": summarize_client(records, health, s["median_ttft_ms"])}


def line(r: dict) -> str:
    cpu = ", ".join(f"{100 * c:.0f}%" for c in r["client"]["cpu"] if c is not None)
    return (f"client ceiling: {r['output_throughput']:,.0f} streamed tokens/s over {r['streams']} streams "
            f"({r['completed']} completed, {r['failed']} failed, {r['duration']:.2f} s); {r['client_workers']} "
            f"client worker(s) [{cpu} of a core], {r['stub_processes']} stub process(es), {r['cores']} cores")
