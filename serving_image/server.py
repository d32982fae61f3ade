"""Run the app under uvicorn with a graceful drain on SIGTERM.

uvicorn's own ``handle_exit`` stops accepting connections at once and, after
shutting down, re-raises the signal (so the process would die of SIGTERM,
not exit 0). Kubernetes wants something else: on SIGTERM the pod should turn
unready, refuse new work with 503 (the Service stops routing to it within a
few seconds), let in-flight requests finish, and only then exit 0. So
:class:`KilnServer` overrides ``handle_exit``: the first SIGTERM/SIGINT
starts a drain; when nothing is in flight (or ``drain_timeout`` passes and
the rest are aborted with ``finish_reason: "abort"``) it sets
``should_exit`` and uvicorn's normal shutdown runs. A second signal exits
at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from kiln.serving.app import ServingContext, create_app
from kiln.serving.config import ServeConfig
from kiln.serving.state import DRAINING, READY

log = logging.getLogger("kiln.serving")

# After a drain timeout, how long aborted streams get to send their final chunk.
_ABORT_GRACE_S = 5.0


class KilnServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServingContext, drain_timeout: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._signalled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.ctx.on_fatal = self._stop_now
        await super().serve(sockets)

    def _stop_now(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only flip flags and schedule work on the loop.
        if self._signalled or self._loop is None:
            self.force_exit = self.should_exit = True
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signame: str) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(signame))

    async def _drain(self, signame: str) -> None:
        state = self.ctx.state
        if state.phase != READY:  # still loading (or failed): nothing to drain
            log.info("received %s while %s; exiting", signame, state.phase)
            self.should_exit = True
            return
        state.phase = DRAINING
        log.info("received %s: draining %d in-flight request(s), up to %.0fs", signame, state.num_in_flight,
                 self.drain_timeout)
        if not await state.wait_idle(self.drain_timeout):
            log.warning("drain timeout (%.0fs) passed; aborting %d request(s)", self.drain_timeout,
                        state.num_in_flight)
            for generation in list(state.generations):
                generation.abort()
            await state.wait_idle(_ABORT_GRACE_S)
        log.info("drained; shutting down")
        self.should_exit = True


def run_server(config: ServeConfig) -> int:
    """Serve until drained; returns the process exit code (0, or 1 when the model failed to load)."""
    app = create_app(config)
    ctx: ServingContext = app.state.kiln
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, access_log=config.access_log,
        timeout_graceful_shutdown=5, lifespan="on", log_config=None,
    )
    server = KilnServer(uv_config, ctx, drain_timeout=config.drain_timeout)
    server.run()
    return ctx.exit_code if server.started or ctx.exit_code else 1
