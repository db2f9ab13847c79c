"""The `mvllm` command line: thin wrappers, one function per subcommand."""

from __future__ import annotations

import functools
import signal
import sys

import typer
from rich.console import Console

from mvllm.errors import MvllmError
from mvllm.model.presets import DEFAULT_MODEL
from mvllm.routing.policies import POLICIES

POLICY_NAMES = ", ".join(POLICIES)
MODEL_HELP = "Model spec (see `mvllm generate --help`)."
BACKENDS = "NAME=DEVICE[/KEY=VALUE]... comma-separated, e.g. gpu=cuda,cpu=cpu/threads=8"
DEFAULT_BACKENDS = "(default: a GPU if present, and the CPU)"
GOODPUT_HELP = ("An SLO as vLLM's KEY:MS, KEY one of ttft, tpot, e2el; repeat it, or give several in one value "
                "(\"ttft:500 e2el:5000\"). Goodput: completed requests per second meeting every one.")

app = typer.Typer(help="Serve a language model on CPU and GPU backends at once, and benchmark how whole "
                       "requests should be routed between them.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False, rich_markup_mode=None)
console = Console(stderr=True, soft_wrap=True)


@app.callback()
def _root() -> None:
    """mvllm: profile, serve, bench and report."""


def one_line_errors(fn):
    """Bad input ends in one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MvllmError as e:
            console.print(f"[red]error:[/red] {e}", highlight=False)
            sys.exit(2)
        except FileNotFoundError as e:
            console.print(f"[red]error:[/red] {e.strerror}: {e.filename}", highlight=False)
            sys.exit(2)
        except KeyboardInterrupt:
            console.print("interrupted")
            sys.exit(130)

    return wrapper


@app.command()
@one_line_errors
def generate(
    prompt: str = typer.Argument(..., help="A chat message (or, for models without a tokenizer, "
                                           "comma-separated token ids)."),
    model: str = typer.Option(DEFAULT_MODEL, help="HF directory or hub id, .gguf file, smollm2-135m, "
                                                  "or synthetic:<preset>."),
    device: str = typer.Option("cpu", help="cpu, cuda or mps."),
    dtype: str = typer.Option(None, help="float32, bfloat16 or float16 (default: per device)."),
    max_tokens: int = typer.Option(64, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    seed: int = typer.Option(None, help="Seed for sampling."),
    raw: bool = typer.Option(False, help="Send the prompt as plain text, without the chat template."),
):
    """Generate one answer with the offline engine and print it with its speed."""
    from mvllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    with console.status(f"loading {model} on {device}"):
        llm = LLM(model, device=device, dtype=dtype)
    if llm.tokenizer.hf is None:
        out = llm.generate([llm.tokenizer.parse_ids(prompt)], params)[0]
    elif raw:
        out = llm.generate(prompt, params)[0]
    else:
        out = llm.chat([{"role": "user", "content": prompt}], params)
    t = out.metrics
    decode_s = (t.finished - t.first_token) if len(out.token_ids) > 1 else 0.0
    print(out.text if out.text is not None else out.token_ids)
    rate = (len(out.token_ids) - 1) / decode_s if decode_s > 0 else float("nan")
    console.print(f"[dim]{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated; "
                  f"first token {1000 * (t.first_token - t.arrival):.0f} ms, decode {rate:.1f} tok/s "
                  f"({model}, {device}, {mode_name(llm.engine)})[/dim]", highlight=False)


def mode_name(engine) -> str:
    quant = "" if engine.config.quant == "none" else f" {engine.config.quant}"
    return f"{str(engine.dtype).removeprefix('torch.')}{quant}"


@app.command()
@one_line_errors
def profile(
    model: str = typer.Option(DEFAULT_MODEL, help=MODEL_HELP),
    backends: str = typer.Option(None, help=f"{BACKENDS}; NAME=http://HOST:PORT is another OpenAI-compatible "
                                            f"server, measured over HTTP {DEFAULT_BACKENDS}."),
    out: str = typer.Option(None, help="Write the profile JSON here, e.g. results/profile/<name>.json."),
    json_out: bool = typer.Option(False, "--json", help="Print the profile JSON on stdout."),
    baseline: str = typer.Option(None, help="'transformers': also time plain transformers generate on the "
                                            "same model, device and dtype, and save the ratios."),
    lengths: str = typer.Option("128,256,516,1024", help="Cold-prefill prompt lengths (516 sets prefill_rate)."),
    repeats: int = typer.Option(5, help="Repetitions per measurement (the median is kept)."),
    steps: int = typer.Option(16, help="Timed decode steps per batch size."),
    max_active: int = typer.Option(None, help="Override every backend's max_active, the largest decode batch "
                                              "measured (default 4; on CUDA what the KV pool holds, at most 256)."),
    accuracy: bool = typer.Option(True, help="Also measure each backend's mean KL and top-1 agreement against "
                                             "the float32 model on a fixed English text (real weights only)."),
    serving: bool = typer.Option(False, "--serving", help="Then start the backends as `mvllm serve` does and "
                                                          "measure each one's serving overheads over HTTP, the "
                                                          "others busy (request_ms, step_ms: what eta and "
                                                          "`mvllm simulate` add to the profile's times)."),
    contexts: str = typer.Option("0,1024,4096", help="Also decode at these depths (those the context holds): a "
                                                     "prompt of DEPTH tokens, then the timed steps, at batch 1 "
                                                     "and 4 (rows that line up with `llama-bench -d`); saved as "
                                                     "each backend's \"contexts\", by which `mvllm simulate` "
                                                     "prices decode. \"\" skips them."),
):
    """Measure each backend alone: cold and warm prefill, decode step time by batch size (each up to 64, then
    CUDA's graph sizes), the prefill_rate/decode_rate the router uses, and accuracy against float32, into one
    JSON profile."""
    from mvllm.profile.run import cli_profile

    cli_profile(model, backends, out, json_out, baseline, lengths, repeats, steps, max_active, console, accuracy,
                serving, contexts)


@app.command()
@one_line_errors
def serve(
    model: str = typer.Option(DEFAULT_MODEL, help=MODEL_HELP),
    backends: str = typer.Option(None, help=f"{BACKENDS}; NAME=http://HOST:PORT routes to another "
                                            f"OpenAI-compatible server {DEFAULT_BACKENDS}."),
    policy: str = typer.Option(None, help=f"One of {POLICY_NAMES}: mixed is the reference router's cost score, "
                                           "eta the predicted finish time, makespan the predicted end of all "
                                           "booked work, split:K the first K requests to the backend named cpu, "
                                           "share:P a fraction P of them, slo the backend meeting --target-slo "
                                           "(default: with one backend, everything to it; else slo with --profile "
                                           "and --target-slo, eta with --profile, else gpu-only)."),
    profile: str = typer.Option(None, help="Profile JSON from `mvllm profile` (the rates mixed and eta need)."),
    max_active: int = typer.Option(None, help="Most running requests per backend (default 4; on CUDA what the "
                                              "KV pool holds of 1,024-token requests, at most 256)."),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    routing_log: str = typer.Option(None, help="Write one JSON line per routing decision here."),
    warm_prefix: str = typer.Option(None, help="File with a prefix (text, or a JSON list of token ids) to "
                                               "pre-seed every backend's prefix cache with."),
    ready_timeout: float = typer.Option(600, help="Seconds to wait for every backend to load."),
    shutdown_timeout: float = typer.Option(30, help="On SIGTERM or Ctrl-C: seconds to let running requests "
                                                    "finish before aborting them (a second signal: at once)."),
    restart_backends: bool = typer.Option(False, help="Respawn a backend whose worker dies, warm it again and "
                                                      "route to it again."),
    target_slo: str = typer.Option(None, help="The SLO to route by, in --slo's form (e.g. \"ttft:2000 tpot:100\", "
                                              "ms): with --profile the default policy is then slo."),
    api_servers: int = typer.Option(None, help="HTTP processes sharing the port, in front of one core process that "
                                               "routes (default 1: more pay only where one API process is "
                                               "the bottleneck; docs/serving.md)."),
):
    """Serve an OpenAI-compatible API over several backends, each request routed whole to one of them."""
    # Ctrl-C (SIGINT) stops a server still starting as it drains a running one, even where it was started with
    # SIGINT ignored (a shell's background job, as a CI runner may start a harness that starts servers)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from mvllm.server.serve import serve as run

    if shutdown_timeout < 0:
        raise MvllmError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout:g}")
    run(model, backends, policy, profile, max_active, host, port, routing_log, warm_prefix,
        ready_timeout, shutdown_timeout, restart_backends, target_slo, api_servers)


# the capacity search's options, the same for bench and simulate
SLO_SHARE = typer.Option(0.99, help="With --slo: the share of requests that must meet it.")
LOADS = typer.Option(None, help="With --slo: LOW:HIGH, the search's first bounds in the experiment's load unit "
                                "(default: a quarter of its load, and its load).")
TOLERANCE = typer.Option(0.05, help="With --slo: stop when the bounds are this close (relative).")


@app.command()
@one_line_errors
def bench(
    experiment: str = typer.Argument(None, help="An experiment file (experiments/*.toml). Without one: the "
                                                "reference workload on the default model and backends."),
    policy: str = typer.Option(None, help="Comma-separated policies to run instead of the experiment's: "
                                          f"{POLICY_NAMES}."),
    runs: int = typer.Option(None, help="Runs per policy (default: the experiment's)."),
    out: str = typer.Option(None, help="Results folder (default: results/<experiment name>)."),
    url: str = typer.Option(None, help="Benchmark this external OpenAI-compatible server instead "
                                       "(e.g. http://127.0.0.1:8000); nothing is started or warmed."),
    model: str = typer.Option(None, help="Model for the default experiment (ignored with a file)."),
    quiet: bool = typer.Option(False, "--quiet", help="No live display or tables."),
    json_out: bool = typer.Option(False, "--json", help="Print the aggregate as JSON on stdout."),
    goodput: list[str] = typer.Option(None, metavar="KEY:MS",
                                      help=GOODPUT_HELP + " Replaces the experiment's `goodput` table."),
    client_workers: int = typer.Option(None, help="Client processes that share the load (default: the "
                                                  "experiment's `client_workers`, else a quarter of the cores, "
                                                  "1 to 8)."),
    api_servers: int = typer.Option(None, help="The servers' API processes (serve --api-servers; default: the "
                                               "experiment's `api_servers`, else 1)."),
    warmup: int = typer.Option(None, help="Requests sent at once to each server bench starts (or once to --url) "
                                          "before its first run, replies dropped, its caches emptied after "
                                          "(default: the experiment's `warmup`, else 0)."),
    selftest: bool = typer.Option(False, "--selftest", help="Instead: measure the client's own ceiling here, "
                                                            "streaming from a stub server (1,024 streams of "
                                                            "256 tokens)."),
    slo: str = typer.Option(None, help="Instead: find each policy's highest load at which --slo-share of the "
                                       "requests meet this SLO, e.g. \"ttft:2000 tpot:50\" (ms; ttft, tpot, e2el), "
                                       "by bisection, each point one run on a live server (<out>/capacity/: "
                                       "capacity.json, capacity.png, a folder a run)."),
    slo_share: float = SLO_SHARE,
    loads: str = LOADS,
    tolerance: float = TOLERANCE,
):
    """Replay a workload against mvllm servers it starts, policy against policy, and save what a user would feel:
    TTFT, TPOT, ITL, end-to-end latency, throughput and batch completion time."""
    import json
    from pathlib import Path

    from mvllm.bench import experiment as ex
    from mvllm.bench.runner import bench as run
    from mvllm.slo import parse_slo

    if client_workers is not None and client_workers < 1:
        raise MvllmError(f"--client-workers must be at least 1, got {client_workers}")
    if api_servers is not None and api_servers < 1:
        raise MvllmError(f"--api-servers must be at least 1, got {api_servers}")
    if warmup is not None and warmup < 0:
        raise MvllmError(f"--warmup must be 0 or more, got {warmup}")
    if selftest:
        from mvllm.bench.selftest import ceiling, line

        with console.status("measuring the client's ceiling against the stub server"):
            result = ceiling(client_workers)
        print(json.dumps(result, indent=2) if json_out else line(result))
        return
    exp = ex.load(experiment) if experiment else ex.default(model)
    if client_workers is not None:
        exp.client_workers = client_workers
    if api_servers is not None:
        exp.api_servers = api_servers
    if warmup is not None:
        exp.warmup = warmup
    if goodput:
        exp.goodput = parse_slo(goodput)
    policies = [p.strip() for p in policy.split(",") if p.strip()] if policy else None
    home = Path(out) if out else Path("results") / exp.name
    if slo is not None:
        data = bench_capacity(exp, home, policies, url, slo, slo_share, loads, tolerance, runs, goodput,
                              quiet or json_out)
        if json_out:
            print(json.dumps(data, indent=2, default=str))
        return
    rows = run(exp, home, policies, runs, url, console, quiet or json_out)
    if json_out:
        print(json.dumps(rows, indent=2, default=str))


def bench_capacity(exp, home, policies, url, slo, share, loads, tolerance, runs, goodput, quiet) -> dict:
    """bench --slo: the capacity search (mvllm/capacity.py), each point a live run (bench/capacity.py)."""
    from mvllm.bench.capacity import Live
    from mvllm.capacity import load_of, parse_goal, run_capacity

    goal = parse_goal(slo, share, loads, tolerance)
    for given, flag, why in ((runs is not None, "--runs", "each point of the search is one run"),
                             (bool(goodput), "--goodput", "each run's goodput is counted against --slo")):
        if given:
            raise MvllmError(f"{flag} does not apply with --slo: {why}")
    if exp.sweep is not None:
        raise MvllmError(f"--slo searches one experiment's load, and {exp.name} sweeps {exp.sweep.knob}; "
                         "search a copy without its sweep")
    load = load_of(exp)
    folder = home / "capacity"
    with Live(exp, folder, policies, url, goal.slo, load.knob, load.unit, console, quiet, home) as live:
        return run_capacity(exp, live.policies, folder, goal, live.measure, console, "measured", live.info, quiet)


@app.command()
@one_line_errors
def simulate(
    experiment: str = typer.Argument(..., help="An experiment file (experiments/*.toml)."),
    profile: str = typer.Option(None, help="Profile JSON to model the backends from (default: the "
                                           "experiment's; for profile = \"auto\", results/<name>/profile.json)."),
    policy: str = typer.Option(None, help=f"Comma-separated policies instead of the experiment's: "
                                          f"{POLICY_NAMES}."),
    out: str = typer.Option(None, help="Where each policy's summary.json goes (default: "
                                       "results/<name>/simulated)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summaries as JSON on stdout."),
    grid: bool = typer.Option(False, "--grid", help="Instead: sweep the CPU's relative speed and the load, and "
                                                    "chart where mixed, eta and the best static split beat "
                                                    "gpu-only (grid.json, grid.png)."),
    spread: float = typer.Option(0.08, help="Also simulate every backend's steps this much faster and slower "
                                            "(a host's run-to-run drift; 0.08 measured on the H200) and show "
                                            "the p95 TTFT band; 0 skips it (a third of the time)."),
    warm_lengths: bool = typer.Option(False, "--warm-lengths",
                                      help="Start the router's length estimate from the workload sent once "
                                           "before (a server that has served this traffic), not from nothing."),
    slo: str = typer.Option(None, help="Instead: find each policy's highest load at which --slo-share of "
                                       "the requests meet this SLO, e.g. \"ttft:2000 tpot:50\" (ms; ttft, tpot, "
                                       "e2el), by bisection (capacity.json, capacity.png)."),
    slo_share: float = SLO_SHARE,
    loads: str = LOADS,
    tolerance: float = TOLERANCE,
    url: str = typer.Option(None, hidden=True),  # bench's option, refused in one line
):
    """Predict an experiment from a profile without running it: its workload through the real router and
    policies, each backend modelled by eta's timing model; measured results shown beside where they exist."""
    import json
    from pathlib import Path

    from mvllm.bench import experiment as ex
    from mvllm.routing.rates import load_profile
    from mvllm.simulate.sim import measured, table
    from mvllm.simulate.sim import simulate as run

    if url:
        raise MvllmError("simulate cannot model an external server (--url): it has no profile of its "
                         "backends; measure it with `mvllm bench --url`, or profile it as a remote backend")
    exp = ex.load(experiment)
    policies = [ex.check_policy(p.strip()) for p in policy.split(",") if p.strip()] if policy else exp.policies
    said = ""
    try:
        path = Path(profile) if profile else ex.find_profile(exp)  # "auto": the file bench measured, not here
    except ex.ExperimentError as e:
        if exp.profile != "auto":
            raise
        path, same = ex.committed_profile(exp)  # the README's commands run on a fresh clone
        if path is None:
            raise MvllmError(f"{e}; no committed profile has {exp.model} on backends {exp.backends}"
                             + (f" (those of {exp.model}: {', '.join(map(str, same))})" if same else "")) from None
        said = f" (results/{exp.name}/profile.json is not there: a committed one of the same model and backends)"
    if path is None:
        raise MvllmError(f"experiment {exp.name} names no profile; pass --profile (made by `mvllm profile`)")
    data = load_profile(path)
    used = f"profile: {path}, measured on {ex.measured_on(path)}{said}"  # said once it ran (an error is one line)
    folder = Path(out) if out else Path("results") / exp.name / "simulated"
    if grid:
        from mvllm.simulate.grid import grid as map_grid

        console.print(f"wrote {map_grid(exp, data, folder)} and grid.png\n{used}", highlight=False)
        return
    if slo is not None:
        from mvllm.simulate.capacity import run_capacity

        run_capacity(exp, data, policies, folder, slo, slo_share, loads, tolerance, console)
        console.print(used, highlight=False)
        return
    if not 0 <= spread < 1:
        raise MvllmError(f"--spread must be in [0, 1), not {spread}")
    rows = run(exp, data, policies, folder, spread=spread, warm_lengths=warm_lengths,
               say=lambda line: console.print(f"[dim]{line}[/dim]", highlight=False))
    console.print(used, highlight=False)
    console.print(table(exp, rows, measured(Path("results") / exp.name)))
    console.print(f"wrote {len(rows)} summaries under {folder}", highlight=False)
    if json_out:
        print(json.dumps(rows, indent=2))


@app.command()
@one_line_errors
def env(
    backends: str = typer.Option(None, help=f"The backends to explain {DEFAULT_BACKENDS}."),
    json_out: bool = typer.Option(False, "--json", help="Print the facts as JSON on stdout."),
):
    """Say what this machine will run: the torch build (oneDNN, OpenMP, CUDA, MPS), the devices, and for each
    backend the mode it picks and why, its threads, and whether each CPU kernel built (or the first error)."""
    import json

    from mvllm.backends.spec import default_backends
    from mvllm.env import collect, render

    with console.status("checking the machine (a first run builds the CPU kernels)"):
        facts = collect(backends or default_backends())
    if json_out:
        print(json.dumps(facts, indent=2))
    else:
        print(render(facts))


@app.command()
@one_line_errors
def report(
    folder: str = typer.Argument(None, help="One experiment's results folder (default: every experiment "
                                            "under results/)."),
    out: str = typer.Option(None, help="Where charts and summary.md go (default: <folder>/report)."),
    goodput: list[str] = typer.Option(None, metavar="KEY:MS", help=GOODPUT_HELP + " Recomputed from every run's "
                                      "requests.csv, in place of what bench saved."),
):
    """Draw the charts (PNG) and write a markdown summary from saved results alone."""
    from pathlib import Path

    from mvllm.report import report_all
    from mvllm.slo import parse_slo

    slo = parse_slo(goodput) if goodput else None
    for path in report_all(Path(folder) if folder else None, Path(out) if out else None, slo=slo):
        console.print(f"wrote {path}", highlight=False)


if __name__ == "__main__":
    app()
