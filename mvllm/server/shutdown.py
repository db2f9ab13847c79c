"""Graceful shutdown of `mvllm serve` on SIGTERM or SIGINT.

uvicorn's own handler closes the connections of streams in flight and then raises the signal again, which
killed the process before the workers were stopped. Here the first signal drains the cluster instead: new
requests get a 503, running ones may finish for up to the shutdown timeout, the rest end with a final
chunk (finish_reason "abort") and [DONE]; then uvicorn stops and `serve` stops the workers and exits 0.
A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import uvicorn

from mvllm.server.cluster import Cluster

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, cluster: Cluster, timeout: float, console):
        super().__init__(config)
        self.cluster, self.timeout, self.console = cluster, timeout, console
        self.stopping: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.begin_stop, sig)
        try:
            yield
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)

    def begin_stop(self, sig: int) -> None:
        if self.stopping is not None:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        self.console.print(f"mvllm: {signal.Signals(sig).name}: taking no new requests, letting running ones "
                           f"finish for up to {self.timeout:g} s", highlight=False)
        self.stopping = asyncio.ensure_future(self.stop())

    async def stop(self) -> None:
        aborted = await self.cluster.drain(self.timeout)
        if aborted:
            self.console.print(f"mvllm: aborted {aborted} request(s) still running", highlight=False)
        self.should_exit = True
