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
from kiln.serving.loader import freeze_heap
from kiln.serving.pool.settings import PoolSettings
from kiln.serving.server_state import DRAINING, READY
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kiln.serving")

# After a drain timeout, how long aborted streams get to send their final chunk.
_ABORT_GRACE_S = 5.0
_MAX_HEADER_BYTES = 64 * 2**10  # request line + headers; past it uvicorn answers 400


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
        log.info("received %s: draining %d in-flight request(s), up to %.0fs", signame, self.ctx.in_flight()[0],
                 self.drain_timeout)
        if not await self.ctx.wait_idle(self.drain_timeout):
            num_in_flight, generations = self.ctx.in_flight()
            log.warning("drain timeout (%.0fs) passed; aborting %d request(s)", self.drain_timeout, num_in_flight)
            for generation in generations:
                generation.abort()
            await self.ctx.wait_idle(_ABORT_GRACE_S)
        log.info("drained; shutting down")
        self.should_exit = True


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for a request's headers.

    uvicorn closes idle keep-alive connections but waits forever for a request that
    trickles in a byte at a time (slowloris), and every such connection counts against
    ``limit_concurrency``, so a few hundred of them would starve real clients and the
    kubelet's probes. Here a connection whose next request's headers are not complete
    within ``header_read_timeout`` seconds of its first byte (or of connecting) is closed.
    """

    header_read_timeout = 10.0  # set per server by make_protocol()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_read_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers():
            self._arm_header_deadline()
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm_header_deadline()

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self._awaiting_headers() and not self.transport.is_closing():
            log.info("closing a connection whose request headers took over %.0fs", self.header_read_timeout)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)


def make_protocol(header_read_timeout: float) -> type[HeaderTimeoutH11Protocol]:
    return type("KilnH11Protocol", (HeaderTimeoutH11Protocol,), {"header_read_timeout": header_read_timeout})


def run_server(config: ServeConfig, pool: PoolSettings | None = None) -> int:
    """Serve until drained; returns the process exit code (0, or 1 when the model failed to load).
    ``pool``: serve several engines (docs/pools.md)."""
    app = create_app(config, pool)
    ctx: ServingContext = app.state.kiln
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, access_log=config.access_log,
        timeout_graceful_shutdown=5, lifespan="on", log_config=None,
        http=make_protocol(config.header_read_timeout), limit_concurrency=config.max_connections,
        timeout_keep_alive=5, h11_max_incomplete_event_size=_MAX_HEADER_BYTES,
    )
    server = KilnServer(uv_config, ctx, drain_timeout=config.drain_timeout)
    if pool is not None:
        log.info("pool: %d objects frozen out of the cyclic collector before any engine loads", freeze_heap())
    server.run()
    return ctx.exit_code if server.started or ctx.exit_code else 1
