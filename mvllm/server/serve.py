"""`mvllm serve`: start the backend workers, wait until every one is ready, then serve HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from rich.console import Console

from mvllm.backends.spec import BackendSpec, parse_apart, share_cores
from mvllm.backends.spec import api_servers as count_apis
from mvllm.engine.modes import LOSSY
from mvllm.errors import InvalidRequestError
from mvllm.model.loader import load_tokenizer, resolve
from mvllm.model.tokenizer import Tokenizer
from mvllm.routing.policies.registry import is_known, make_policy
from mvllm.routing.policies.slo import idle_misses
from mvllm.routing.rates import load_profile, rates_as_served
from mvllm.routing.router import Router
from mvllm.server.app import build_app
from mvllm.server.cluster import Cluster
from mvllm.server.stream import direct_send
from mvllm.slo import parse_slo

console = Console(stderr=True, soft_wrap=True)


def read_rates(profile: str | dict | None, specs: list[BackendSpec]) -> dict[str, dict] | None:
    """Each backend's profiled rates, as it will serve (routing/rates.py); `profile`: its path, or its data."""
    if not profile:
        return None
    data = load_profile(profile) if isinstance(profile, str) else profile
    return rates_as_served(data, {s.name: s.max_active for s in specs if s.max_active is not None})


def thread_warnings(profile: str | None, data: dict | None, specs: list[BackendSpec]) -> list[str]:
    """One line per CPU backend that the profile (`data`, read from `profile`) measured with other threads than
    it serves with (after share_cores): its rates were another speed's."""
    if not data:
        return []
    have = data.get("backends", {})
    return [f"{profile} measured backend {s.name} with {have[s.name]['threads']} thread(s); it serves with "
            f"{s.threads}: its rates may not hold (`mvllm profile` again, or /threads={have[s.name]['threads']})"
            for s in specs if s.device == "cpu" and s.name in have and have[s.name].get("threads") not in
            (None, s.threads)]


def read_prefix(path: str | None) -> str | list[int] | None:
    """A warm-prefix file holds text, or a JSON list of token ids."""
    if not path:
        return None
    text = Path(path).read_text()
    try:
        ids = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return ids
    raise InvalidRequestError(f"{path}: a warm prefix is text or a JSON list of token ids", "warm_prefix")


def lossy_warnings(specs: list[BackendSpec]) -> list[str]:
    """One line per backend whose mode fails the accuracy bound (mvllm/profile/accuracy.py)."""
    return [f"backend {s.name} runs quant={s.quant}, which changes the model's answers (mean KL 1.0 nats/token "
            "against float32 on SmolLM2; the default CPU mode is accurate)" for s in specs if s.quant in LOSSY]


def choose_policy(policy: str | None, profile: str | None, backends: list[str] | None = None,
                  target_slo: dict | None = None) -> str:
    """Without --policy: everything to the one backend where there is one (NAME-only where the registry has
    it, else round-robin, which has only it to turn to); with a profile, slo where a target SLO is given, else
    eta; without one, everything to the gpu backend. On the H200, eta never lost to gpu-only and the
    reference's mixed did (results/README.md); at an SLO, slo carries more load than either (docs/routing.md)."""
    if policy:
        return policy
    if backends is not None and len(backends) == 1:
        return f"{backends[0]}-only" if is_known(f"{backends[0]}-only") else "round-robin"
    return ("slo" if target_slo else "eta") if profile else "gpu-only"


def unmet_warning(router: Router) -> str | None:
    """The line to say once at start where no backend meets the router's target SLO even idle."""
    slo = router.target_slo
    if not slo or not router.timings:
        return None
    missed = {b: idle_misses(t, slo) for b, t in router.timings.items()}
    if not all(missed.values()):
        return None
    return ("no backend meets --target-slo even idle (" + "; ".join(f"{b}: {', '.join(m)}" for b, m in
                                                                    missed.items()) + "): serving anyway")


def serve(model: str, backends: str | None, policy: str | None, profile: str | None, max_active: int | None, host: str,
          port: int, routing_log: str | None, warm_prefix: str | None, ready_timeout: float,
          shutdown_timeout: float = 30.0, restart_backends: bool = False, target_slo: str | None = None,
          api_servers: int | None = None) -> None:
    import uvicorn

    from mvllm.server.shutdown import GracefulServer

    if policy is not None and not is_known(policy):  # said before the backends are checked (seconds: torch)
        make_policy(policy, [])  # raises the registry's one line
    if api_servers is not None and api_servers < 1:
        raise InvalidRequestError(f"--api-servers must be at least 1, got {api_servers}", "api_servers")
    specs = parse_apart(backends, max_active)  # backends None: default_backends()
    apis = count_apis(api_servers)[0]
    share_cores(specs, apis=apis)
    data = load_profile(profile) if profile else None  # read once: its rates and its threads
    for line in lossy_warnings(specs) + thread_warnings(profile, data, specs):
        console.print(f"[yellow]warning:[/yellow] {line}", highlight=False)
    target = parse_slo([target_slo], "--target-slo") if target_slo else None
    if target_slo is not None and not target:
        raise InvalidRequestError("--target-slo names no bound; e.g. --target-slo \"ttft:2000 tpot:100\"", "slo")
    chosen = choose_policy(policy, profile, [s.name for s in specs], target)
    if policy is None and len(specs) == 1:
        console.print(f"mvllm: one backend ({specs[0].name}): every request goes to it (policy {chosen}; "
                      "--policy picks another)", highlight=False)
    policy = chosen
    router = Router([s.name for s in specs], policy, read_rates(data, specs), routing_log, slo=target)
    unmet = unmet_warning(router)
    if unmet:
        console.print(f"[yellow]warning:[/yellow] {unmet}", highlight=False)
    prefix = read_prefix(warm_prefix)
    source = resolve(model)
    tokenizer = Tokenizer(load_tokenizer(source), model)
    if prefix is not None:
        tokenizer.encode(prefix)
    cluster = Cluster(specs, model, router, restart=restart_backends, ready_timeout=ready_timeout)
    try:
        with console.status(f"starting {len(specs)} backends for {model}"):
            cluster.wait_ready(ready_timeout)
        ready = {name: info.get("ready_s") for name, info in cluster.snapshots.items()}
        for name, why in cluster.start_errors.items():
            console.print(f"[red]error:[/red] {why}; serving without backend {name}", highlight=False)
        names = ", ".join(f"{s.name}={s.device}" + (f" ready in {ready[s.name]} s" if ready.get(s.name) else "")
                          for s in specs if s.name not in cluster.start_errors)
        where = f"(backends {names}; policy {policy}"
        if apis > 1:
            serve_apart(cluster, apis, host, port, model, source, tokenizer.encode(prefix) if prefix else None,
                        ready_timeout, shutdown_timeout, where + f"; {apis} API processes)")
        else:
            app = build_app(cluster, tokenizer, model, source.config.vocab_size, prefix,
                            source.config.max_position)
            console.print(f"mvllm: serving {model} on http://{host}:{port} {where})")
            logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
            config = uvicorn.Config(direct_send(app), host=host, port=port, log_level="warning",
                                    timeout_graceful_shutdown=5, timeout_keep_alive=30)
            GracefulServer(config, cluster, shutdown_timeout, console).run()
    finally:
        cluster.shutdown()
    console.print("mvllm: stopped")


def serve_apart(cluster: Cluster, apis: int, host: str, port: int, model: str, source, prefix: list[int] | None,
                ready_timeout: float, shutdown_timeout: float, where: str) -> None:
    """This process as the core, `apis` API processes serving HTTP (server/core.py); `where`: the end of the
    ready line."""
    from mvllm.server.core import Core
    from mvllm.server.wire import port_socket

    sock = port_socket(host, port, listen=False)  # holds the port; the API processes listen on it
    port = sock.getsockname()[1]  # port 0: the one the system gave
    ready_line = f"mvllm: serving {model} on http://{host}:{port} {where}"
    start = dict(host=host, port=port, model=model, vocab_size=source.config.vocab_size,
                 context=source.config.max_position, snapshots=cluster.snapshots, names=list(cluster.backends))
    core = Core(cluster, apis, start, console)
    try:
        asyncio.run(core.run(prefix, ready_timeout, shutdown_timeout, ready_line))
    except asyncio.CancelledError:  # a second signal
        pass
    finally:
        sock.close()
