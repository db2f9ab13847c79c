"""A fresh `mvllm serve` in its own process: start, wait until ready, warm, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mvllm.errors import MvllmError


class ServerError(MvllmError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_client() -> httpx.Client:
    """A client for repeated calls to a local server. httpx.get builds a client, and its TLS context (~45 ms of
    CPU), at every call: a poll of /health four times a second took a fifth of a core. A fresh connection each
    call still, as httpx.get makes."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no server log)"
    return "\n".join("    " + line for line in lines[-n:]) or "    (the server printed nothing)"


class ServerProcess:
    def __init__(self, args: list[str], log: Path, host: str = "127.0.0.1", port: int | None = None,
                 env: dict | None = None, cwd: Path | None = None):
        """cwd: where the server runs (its mvllm is the one there, where there is one: `python -m` looks there
        first)."""
        self.host, self.port = host, port or free_port()
        self.command = [sys.executable, "-m", "mvllm.cli", "serve", "--shutdown-timeout", "5", *args, "--host", host,
                        "--port", str(self.port)]
        self.log, self.env, self.cwd = log, env, cwd
        self.proc: subprocess.Popen | None = None
        self._http: httpx.Client | None = None

    @property
    def http(self) -> httpx.Client:
        """The client for the calls to this server (local_client)."""
        if self._http is None:
            self._http = local_client()
        return self._http

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(self.command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=self.env, cwd=self.cwd)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"the server exited with code {self.proc.returncode} before it was ready; "
                                  f"its last log lines ({self.log}):\n{tail(self.log)}")
            try:
                health = self.http.get(f"{self.url}/health", timeout=2.0)
                if health.status_code == 200:
                    return
                failed = [b["start_error"] for b in health.json().get("backends", {}).values() if "start_error" in b]
                if failed:  # it serves without them; a benchmark needs every backend it names
                    raise ServerError(f"the server started without a backend: {'; '.join(failed)}")
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(0.25)
        raise ServerError(f"the server was not ready after {timeout:g} s; its last log lines ({self.log}):\n"
                          f"{tail(self.log)}")

    def warm(self, prefix: list[int]) -> dict:
        r = self.http.post(f"{self.url}/v1/warm", json={"prompt": prefix}, timeout=600.0)
        if r.status_code != 200:
            raise ServerError(f"warming the prefix failed: HTTP {r.status_code}: {r.text[:300]}")
        return r.json().get("cached_tokens", {})

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
