"""Prometheus metrics for /metrics, named like vLLM's where one exists."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ROUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


class Metrics:
    def __init__(self, backends: list[str]):
        r = self.registry = CollectorRegistry()
        b = ["backend"]
        self.backend_up = Gauge("mvllm_backend_up", "1 while the backend's worker process is alive", b, registry=r)
        self.running = Gauge("mvllm_num_requests_running", "Requests running on the backend", b, registry=r)
        self.waiting = Gauge("mvllm_num_requests_waiting", "Requests waiting on the backend", b, registry=r)
        self.kv_usage = Gauge("mvllm_kv_cache_usage_perc", "Fraction of KV blocks in use", b, registry=r)
        self.prefix_queries = Gauge("mvllm_prefix_cache_queries", "Prefix-cache look-ups at admission", b, registry=r)
        self.prefix_hits = Gauge("mvllm_prefix_cache_hits", "Admissions that found a cached prefix", b, registry=r)
        self.routed = Counter("mvllm_routing_decisions", "Requests the router placed on each backend", b, registry=r)
        self.prompt_tokens = Counter("mvllm_prompt_tokens", "Prompt tokens of finished requests", b, registry=r)
        self.cached_tokens = Counter("mvllm_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     b, registry=r)
        self.generation_tokens = Counter("mvllm_generation_tokens", "Generated tokens", b, registry=r)
        self.ttft = Histogram("mvllm_time_to_first_token_seconds", "Time to first token", b, buckets=BUCKETS,
                              registry=r)
        self.e2e = Histogram("mvllm_e2e_request_latency_seconds", "End-to-end request latency", b,
                             buckets=BUCKETS, registry=r)
        self.restarts = Counter("mvllm_backend_restarts", "Times the backend's worker was respawned", b, registry=r)
        self.rerouted = Counter("mvllm_requests_rerouted", "Requests moved off the backend when it died before "
                                "sending them a token", b, registry=r)
        self.route_seconds = Histogram("mvllm_routing_decision_seconds", "The router's time to place one request "
                                       "(its policy's scores and the block hashes it reads)", buckets=ROUTE_BUCKETS,
                                       registry=r)
        self.stale_cache = Gauge("mvllm_stale_prefix_estimates", "Requests admitted with less cached than the "
                                 "router counted when it placed them (evicted meanwhile)", b, registry=r)
        self._labelled: dict[tuple[str, str], tuple] = {}
        for name in backends:
            self.backend_up.labels(name).set(1)
            self.running.labels(name).set(0)  # every backend's load is read from the start, before its first step
            self.waiting.labels(name).set(0)
            for counter in (self.routed, self.restarts, self.rerouted):
                counter.labels(name)

    def observe_snapshot(self, name: str, snap: dict) -> None:
        running, waiting, kv_usage, queries, hits = self._children("snapshot", name)
        running.set(snap["running"])
        waiting.set(snap["waiting"])
        kv_usage.set(snap["kv_usage"])
        queries.set(snap["prefix_queries"])
        hits.set(snap["prefix_hits"])

    def observe_request(self, name: str, prompt: int, cached: int, generated: int, ttft: float | None,
                        e2e: float) -> None:
        prompt_tokens, cached_tokens, generation_tokens, ttfts, e2es = self._children("request", name)
        prompt_tokens.inc(prompt)
        cached_tokens.inc(cached)
        generation_tokens.inc(generated)
        if ttft is not None:
            ttfts.observe(ttft)
        e2es.observe(e2e)

    KINDS = {"snapshot": ("running", "waiting", "kv_usage", "prefix_queries", "prefix_hits"),
             "request": ("prompt_tokens", "cached_tokens", "generation_tokens", "ttft", "e2e")}

    def _children(self, kind: str, name: str) -> tuple:
        """A backend's labelled children of the metrics of `kind` (KINDS), looked up once: every step sets the
        snapshot's."""
        if (found := self._labelled.get((kind, name))) is None:
            found = self._labelled[kind, name] = tuple(getattr(self, m).labels(name) for m in self.KINDS[kind])
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
