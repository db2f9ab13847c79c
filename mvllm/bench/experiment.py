"""Experiment files: TOML that names the model, backends, profile, policies, runs and workload.

    name = "paper-8"
    model = "synthetic:qwen2.5-0.5b"
    backends = "default"            # or a backend spec, e.g. "gpu=cuda,cpu=cpu/threads=8"
    max_active = 4
    profile = "auto"                # a profile JSON, "auto" (run `mvllm profile` once), or absent
    profile_args = ["--repeats", "3"]   # extra `mvllm profile` options for "auto"
    policies = ["gpu-only", "mixed"]
    runs = 3
    [workload]
    requests = 8
    prefix_tokens = 496
    suffix_tokens = 20
    # prompt_tokens = 516           # optional: fixed prompt length, the shared prefix is what the suffix leaves
    output_tokens = 128
    arrival = "fixed"               # fixed (interval s) | poisson (rate req/s) | gamma (rate, burstiness)
    interval = 0.05
    # duration = 60                 # optional: send for this many seconds (replaces `requests`)
    [sweep]                         # optional: one knob, several values
    knob = "workload.suffix_tokens" # or "max_active", or one backend's setting: "backends.gpu.max_active"
    values = [20, 100, 500]

server = "fresh" starts a new server for every run; "shared" keeps one server for all runs with the same
model, backends and max_active, and before each run empties its prefix caches (POST /reset_prefix_cache),
sets the policy (POST /v1/policy) and warms the prefix again: much less time spent starting servers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from mvllm.bench.metrics import check_slo
from mvllm.errors import MvllmError
from mvllm.routing.policies import POLICIES, is_known

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ARRIVALS = ("fixed", "poisson", "gamma", "trace")
SERVERS = ("fresh", "shared")


class ExperimentError(MvllmError):
    pass


@dataclass(slots=True)
class Workload:
    kind: str = "prefix"
    requests: int | None = None
    prefix_tokens: int | None = None
    suffix_tokens: int | None = None
    output_tokens: int | None = None
    arrival: str | None = None
    interval: float = 0.05
    rate: float | None = None
    burstiness: float = 1.0
    seed: int = 0
    warm: bool | None = None
    vocab: int | None = None
    prompt_tokens: int | None = None
    duration: float | None = None
    lengths: str | None = None
    max_tokens: int | None = None
    path: str | None = None
    block_tokens: int = 512
    scale: float = 1.0
    speedup: float = 1.0
    start: float = 0.0
    max_requests: int | None = None
    max_prompt_tokens: int | None = None
    over: str = "drop"
    range_ratio: float = 0.0
    groups: int = 8
    prompts_per_group: int = 4
    turns: int = 1
    think_time: float = 0.0
    output_from: str | None = None

    def __post_init__(self):
        for key, value in KIND_DEFAULTS.get(self.kind, {}).items():  # an unknown kind is refused by check()
            if getattr(self, key) is None:
                setattr(self, key, value)

    @property
    def request_rate(self) -> float:
        return self.rate if self.rate is not None else 1.0 / self.interval

    @property
    def hidden(self) -> bool:
        return self.lengths == "hidden"


# Each kind's own keys (beside COMMON_KEYS) and its defaults; a key of another kind is refused by name.
COMMON_KEYS = ("kind", "arrival", "interval", "rate", "burstiness", "seed", "warm", "vocab", "duration", "lengths",
               "max_tokens", "max_prompt_tokens", "over")
KIND_KEYS = {
    "prefix": ("requests", "prefix_tokens", "suffix_tokens", "output_tokens", "prompt_tokens", "output_from",
               "scale"),
    "trace": ("path", "block_tokens", "scale", "speedup", "start", "max_requests"),
    "random": ("requests", "prefix_tokens", "suffix_tokens", "output_tokens", "range_ratio", "output_from", "scale"),
    "shared-prefix": ("groups", "prompts_per_group", "prefix_tokens", "suffix_tokens", "output_tokens",
                      "range_ratio", "turns", "think_time"),
    "custom": ("path", "speedup", "max_requests"),
}
KIND_DEFAULTS = {
    "prefix": dict(requests=8, prefix_tokens=496, suffix_tokens=20, output_tokens=128, lengths="told", warm=True,
                   arrival="fixed"),
    "trace": dict(lengths="hidden", warm=False, arrival="trace"),
    "random": dict(requests=64, prefix_tokens=0, suffix_tokens=512, output_tokens=128, lengths="hidden",
                   warm=False, arrival="poisson"),
    "shared-prefix": dict(prefix_tokens=512, suffix_tokens=64, output_tokens=128, lengths="hidden", warm=False,
                          arrival="poisson"),
    "custom": dict(lengths="hidden", warm=False, arrival="fixed"),
}
LENGTHS = ("told", "hidden")
OVER = ("drop", "clip")


@dataclass(slots=True)
class Sweep:
    knob: str
    values: list


@dataclass(slots=True)
class Experiment:
    name: str
    model: str
    backends: str = "default"
    max_active: int | None = 4
    profile: str | None = None
    profile_args: list[str] = field(default_factory=list)
    policies: list[str] = field(default_factory=lambda: ["gpu-only", "mixed"])
    runs: int = 3
    server: str = "fresh"
    ready_timeout: float = 600.0
    request_timeout: float = 600.0
    client_workers: int | None = None  # client processes; None: loadgen.auto_workers()
    api_servers: int = 1  # the servers' API processes (serve --api-servers)
    warmup: int = 0  # requests replayed at once on each server bench starts, before its first run (runner.warm_up)
    goodput: dict | None = None  # SLOs in ms, e.g. {"ttft_ms": 500, "e2el_ms": 5000}: the summary adds goodput
    description: str = ""
    workload: Workload = field(default_factory=Workload)
    sweep: Sweep | None = None
    path: Path | None = None

    def points(self) -> list[tuple[object, Experiment]]:
        """(knob value, experiment with that value applied); one point (None, self) without a sweep."""
        if self.sweep is None:
            return [(None, self)]
        return [(v, apply(self, self.sweep.knob, v)) for v in self.sweep.values]


def check_policy(name: str) -> str:
    if is_known(name):
        return name
    raise ExperimentError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


def find_profile(exp: Experiment, results: Path | None = None,
                 measure: Callable[[Experiment, Path], None] | None = None) -> Path | None:
    """The profile an experiment routes by; None where it names none. Its `profile` is a file (relative to the
    current folder, else to the experiment file; checked as a profile) or "auto": profile.json in the results
    folder (`results`, default results/<name>), measured there by `mvllm profile`; for an experiment file that
    is a run's copy under results/, the profile.json beside it or in one of the two folders above (a group's shared
    one: results/<group>/<policy>/capacity/experiment.toml reads results/<group>/profile.json). `mvllm bench` passes
    `measure(exp, path)`, which makes that file or keeps one that covers the experiment (runner.measure);
    `mvllm simulate` passes none, and reads the file an earlier bench measured."""
    if exp.profile is None:
        return None
    if exp.profile == "auto":
        if results is None and measure is None and exp.path is not None and exp.path.name == "experiment.toml":
            for beside in (folder / "profile.json" for folder in exp.path.parents[:3]):
                if beside.is_file():
                    return beside
        path = (results if results is not None else Path("results") / exp.name) / "profile.json"
        if measure is not None:
            measure(exp, path)
        elif not path.is_file():
            raise ExperimentError(f"experiment {exp.name} measures its profile when benched ('auto') and {path} "
                                  "does not exist yet; pass --profile")
        return path
    for base in (Path.cwd(), exp.path.parent if exp.path else Path.cwd()):
        path = (base / exp.profile).resolve()
        if path.is_file():
            from mvllm.routing.rates import load_profile

            load_profile(path)
            return path
    raise ExperimentError(f"key 'profile': no profile file {exp.profile!r} (looked relative to the current "
                          f"folder and to the experiment file)")


def measured_on(path: Path) -> str:
    """Where and when a profile was measured, from its environment: "NVIDIA H200 and Intel(R) Xeon(R) Processor,
    2026-11-30"."""
    import json

    data = json.loads(Path(path).read_text())
    env = data.get("environment") or {}
    machine = " and ".join(x for x in (env.get("gpu"), env.get("cpu_model")) if x) or "an unrecorded machine"
    return f"{machine}, {str(data.get('created') or env.get('date') or '?')[:10]}"


def _backends(text: str) -> set[tuple[str, str]]:
    """{(name, device)} of a backends string, without checking it against this machine."""
    from mvllm.backends.spec import split_device

    return {(name.strip(), split_device(rest)[0]) for name, _, rest in (p.partition("=") for p in text.split(","))}


def committed_profile(exp: Experiment, results: Path = Path("results")) -> tuple[Path | None, list[Path]]:
    """For `simulate` where the experiment's own profile (results/<name>/profile.json) is not there: the newest
    profile of a committed run of it (results/**/<name>/experiment.toml: beside it, or in one of the two folders above),
    else the newest committed profile of the same model and backends (names and devices); and every committed
    profile of the same model, for the line that says none fits."""
    import json

    def read(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    profiles = {p: read(p) for p in sorted(results.glob("**/profile.json"))}
    same_model = [p for p, d in profiles.items() if d.get("model") == exp.model]
    runs = [next(q for q in (f / "profile.json" for f in t.parents[:3]) if q in profiles)
            for t in results.glob(f"**/{exp.name}/experiment.toml")
            if {f / "profile.json" for f in t.parents[:3]} & profiles.keys()]
    want = _backends(exp.backends) if exp.backends and exp.backends != "default" else None
    fits = runs or [p for p in same_model if want is not None and want == {
        (n, b.get("device")) for n, b in (profiles[p].get("backends") or {}).items()}]
    best = max(fits, key=lambda p: str(profiles[p].get("created", "")), default=None)
    return best, same_model


def load(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"experiment file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ExperimentError(f"{path}: not valid TOML: {e}") from None
    exp = from_dict(data, str(path))
    exp.path = path
    w = exp.workload
    for key in ("path", "output_from"):
        if name := getattr(w, key):
            setattr(w, key, str(find_file(name, path)))
    return exp


def find_file(name: str, experiment: Path) -> Path:
    """A file an experiment names: relative to the current folder, else to the experiment file's folder or one
    above it, or to experiments/ there (a copy under results/<x>/ names it as it was written beside its trace);
    as given where none exists, for the workload to say so."""
    if Path(name).expanduser().exists():
        return Path(name).expanduser()
    for folder in experiment.resolve().parents:
        for base in (folder, folder / "experiments"):
            if (base / name).exists():
                return base / name
    return Path(name)


def from_dict(data: dict, where: str = "experiment") -> Experiment:
    data = dict(data)
    given = data.pop("workload", {})
    check_kind_keys(given, where)
    workload = _build(Workload, given, where, "workload.")
    sweep_data = data.pop("sweep", None)
    for key in ("name", "model"):
        if key not in data:
            raise ExperimentError(f"{where}: missing key {key!r}")
    exp = _build(Experiment, data, where, "", skip=("workload", "sweep", "path"))
    exp.workload = workload
    if sweep_data is not None:
        exp.sweep = _build(Sweep, sweep_data, where, "sweep.")
        if not exp.sweep.values:
            raise ExperimentError(f"{where}: key 'sweep.values' needs at least one value")
        for v in exp.sweep.values:
            apply(exp, exp.sweep.knob, v, where)
    check(exp, where)
    return exp


def check_kind_keys(given, where: str) -> None:
    """The workload's kind is known and every key given belongs to it (one line naming the known ones)."""
    if not isinstance(given, dict):
        return  # _build says it must be a table
    kind = given.get("kind", "prefix")
    if kind not in KIND_KEYS:
        raise ExperimentError(f"{where}: key 'workload.kind' must be one of {', '.join(KIND_KEYS)}, got {kind!r}")
    known = COMMON_KEYS + KIND_KEYS[kind]
    for key in given:
        if key not in known and key in Workload.__dataclass_fields__:
            raise ExperimentError(f"{where}: key 'workload.{key}' does not apply to kind {kind!r}; its keys: "
                                  f"{', '.join('workload.' + k for k in known)}")


def check(exp: Experiment, where: str = "experiment") -> None:
    w = exp.workload
    if w.kind not in KIND_KEYS:
        raise ExperimentError(f"{where}: key 'workload.kind' must be one of {', '.join(KIND_KEYS)}, got {w.kind!r}")
    w.__post_init__()
    if w.prompt_tokens is not None:  # derived once here, so every reader of prefix_tokens agrees
        w.prefix_tokens = w.prompt_tokens - w.suffix_tokens
    rules = [
        (exp.server in SERVERS, "server", f"must be one of {', '.join(SERVERS)}"),
        (w.prompt_tokens is None or w.prompt_tokens >= w.suffix_tokens, "workload.prompt_tokens",
         "must be at least suffix_tokens"),
        (w.duration is None or w.duration > 0, "workload.duration", "must be positive"),
        (w.duration is None or w.arrival != "fixed" or w.interval > 0, "workload.duration",
         "needs a positive interval with fixed arrivals"),
        (exp.runs >= 1, "runs", "must be at least 1"),
        (bool(exp.policies), "policies", "needs at least one policy"),
        (exp.max_active is None or exp.max_active >= 1, "max_active", "must be at least 1"),
        (exp.ready_timeout > 0, "ready_timeout", "must be positive"),
        (exp.request_timeout > 0, "request_timeout", "must be positive"),
        (exp.client_workers is None or exp.client_workers >= 1, "client_workers", "must be at least 1"),
        (exp.api_servers >= 1, "api_servers", "must be at least 1"),
        (exp.warmup >= 0, "warmup", "must be 0 or more"),
        (w.requests is None or w.requests >= 1, "workload.requests", "must be at least 1"),
        (w.prefix_tokens is None or w.prefix_tokens >= 0, "workload.prefix_tokens", "must be 0 or more"),
        (w.suffix_tokens is None or w.suffix_tokens >= 0, "workload.suffix_tokens", "must be 0 or more"),
        (w.kind not in ("prefix", "random", "shared-prefix") or w.prefix_tokens + w.suffix_tokens >= 1,
         "workload.suffix_tokens", "prompt must have a token"),
        (w.output_tokens is None or w.output_tokens >= 1, "workload.output_tokens", "must be at least 1"),
        (w.arrival in ARRIVALS, "workload.arrival", f"must be one of {', '.join(ARRIVALS)}"),
        (w.arrival != "trace" or w.kind in ("trace", "custom"), "workload.arrival",
         "'trace' (the file's own timestamps) needs kind trace or custom"),
        (w.lengths in LENGTHS, "workload.lengths", f"must be one of {', '.join(LENGTHS)}"),
        (w.max_tokens is None or w.max_tokens >= 1, "workload.max_tokens", "must be at least 1"),
        (w.kind not in ("trace", "custom") or bool(w.path), "workload.path", f"is needed by kind {w.kind!r}"),
        (w.block_tokens >= 1, "workload.block_tokens", "must be at least 1"),
        (w.scale > 0, "workload.scale", "must be positive"),
        (w.block_tokens / w.scale >= 1, "workload.scale", "must leave a block of at least one token"),
        (w.speedup > 0, "workload.speedup", "must be positive"),
        (w.start >= 0, "workload.start", "must be 0 or more"),
        (w.max_requests is None or w.max_requests >= 1, "workload.max_requests", "must be at least 1"),
        (w.max_prompt_tokens is None or w.max_prompt_tokens >= 1, "workload.max_prompt_tokens",
         "must be at least 1"),
        (w.over in OVER, "workload.over", f"must be one of {', '.join(OVER)}"),
        (0 <= w.range_ratio < 1, "workload.range_ratio", "must be in [0, 1)"),
        (w.groups >= 1, "workload.groups", "must be at least 1"),
        (w.prompts_per_group >= 1, "workload.prompts_per_group", "must be at least 1"),
        (w.turns >= 1, "workload.turns", "must be at least 1"),
        (w.think_time >= 0, "workload.think_time", "must be 0 or more"),
        (w.interval >= 0, "workload.interval", "must be 0 or more"),
        (w.rate is None or w.rate > 0, "workload.rate", "must be positive"),
        (w.arrival == "fixed" or w.rate is not None or w.interval > 0, "workload.rate",
         "is needed for poisson/gamma arrivals"),
        (w.burstiness > 0, "workload.burstiness", "must be positive"),
        (w.vocab is None or w.vocab >= 64, "workload.vocab", "must be at least 64"),
    ]
    for ok, key, msg in rules:
        if not ok:
            raise ExperimentError(f"{where}: key {key!r} {msg}")
    if exp.goodput is not None:
        exp.goodput = check_slo(exp.goodput, where)
    for p in exp.policies:
        try:
            check_policy(p)
        except ExperimentError as e:
            raise ExperimentError(f"{where}: key 'policies': {e}") from None


def apply(exp: Experiment, knob: str, value, where: str = "experiment") -> Experiment:
    """A copy of `exp` with one knob ("max_active", "workload.suffix_tokens", "backends.gpu.max_active",
    ...) set to value."""
    new = copy.deepcopy(exp)
    if knob.startswith("backends."):
        return _apply_backend(new, knob, value, where)
    target, key = (new.workload, knob[9:]) if knob.startswith("workload.") else (new, knob)
    names = {f.name: f for f in fields(target)}
    if key not in names or key in ("workload", "sweep", "path", "name", "policies", "runs", "description"):
        raise ExperimentError(f"{where}: key 'sweep.knob': {knob!r} is not a setting that can be swept")
    setattr(target, key, _typed(names[key], value, where, f"sweep.values ({knob})"))
    check(new, where)
    return new


def _apply_backend(exp: Experiment, knob: str, value, where: str) -> Experiment:
    from mvllm.backends.spec import convert, default_backends, set_option

    parts = knob.split(".")
    if len(parts) != 3:
        raise ExperimentError(f"{where}: key 'sweep.knob': {knob!r} must look like backends.NAME.SETTING")
    text = default_backends() if exp.backends == "default" else exp.backends
    try:
        convert(parts[2], str(value), parts[1])  # the setting and its value; devices are checked by bench
        exp.backends = set_option(text, parts[1], parts[2], str(value))
    except MvllmError as e:
        raise ExperimentError(f"{where}: key 'sweep.knob' {knob!r} = {value!r}: {e}") from None
    return exp


def _build(cls, data, where: str, prefix: str, skip=()):
    if not isinstance(data, dict):
        raise ExperimentError(f"{where}: key {prefix.rstrip('.')!r} must be a table")
    names = {f.name: f for f in fields(cls) if f.name not in skip}
    values = {}
    for key, value in data.items():
        if key not in names:
            known = ", ".join(prefix + n for n in names)
            raise ExperimentError(f"{where}: unknown key {prefix + key!r}; known: {known}")
        values[key] = _typed(names[key], value, where, prefix + key)
    try:
        return cls(**values)
    except TypeError as e:
        raise ExperimentError(f"{where}: {e}") from None


def _typed(f, value, where: str, key: str):
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    optional = "None" in kind
    if value is None and optional:
        return None
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "list": lambda v: isinstance(v, list),
    }
    base = kind.replace(" | None", "")
    check = ok.get(base)
    if check is not None and not check(value):
        raise ExperimentError(f"{where}: key {key!r} must be {_article(base)}, got {value!r}")
    return float(value) if base == "float" else value


def _article(kind: str) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
            "list[str]": "a list of strings", "list": "a list"}.get(kind, kind)


def default(model: str | None = None) -> Experiment:
    """The reference workload (the published CPU/GPU offload experiment's) on the default model and the default
    backends, one run per policy, rates measured by `mvllm profile` first: what `mvllm bench` does without a
    file."""
    from mvllm.model.presets import DEFAULT_MODEL

    return Experiment(name="default", model=model or DEFAULT_MODEL, runs=1, profile="auto",
                      profile_args=["--lengths", "128,516", "--repeats", "3"],
                      description="The reference workload (the published CPU/GPU offload experiment's) "
                                  "on the default model and backends")
