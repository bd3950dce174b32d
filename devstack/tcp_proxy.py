"""A TCP forwarder on its own event-loop thread, for the multi-host tests: it lets hosts in network
namespaces reach a service that listens on 127.0.0.1 only (the shared PostgreSQL and S3), without
reconfiguring the service.

It forwards bytes both ways and closes the other side when one side closes. It turns TCP keepalive
on for the sockets it accepts (`keepalive_s`): a host cut off by `ip link set ... down` sends no
reset, so without probes the forwarder (and the service behind it, which sees only the forwarder)
would keep a dead host's session open for the kernel's default of about 2 h 11 min
(`tcp_keepalive_time` 7200 s + 9 probes of 75 s). With probes after `keepalive_s` idle seconds,
every second, three of them, a dead peer's session ends about `keepalive_s + 3` seconds after its
last byte. The forwarder stands where a PostgreSQL server's own `tcp_keepalives_idle`,
`tcp_keepalives_interval` and `tcp_keepalives_count` would act (PostgreSQL documentation, "Connections
and Authentication"); the test states which bound it gives.
"""

from __future__ import annotations

import asyncio
import socket
import threading


class TcpForwarder:
    """Listen on `listen` (host, port) and forward each connection to `target` (host, port).

    `keepalive_s`: idle seconds before the first keepalive probe on an accepted socket (None: the
    kernel's default). `start` returns once the port is bound; `stop` closes the listener and every
    forwarded connection. Raises `OSError` from `start` when the address cannot be bound."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], keepalive_s: int | None = 3) -> None:
        self.listen, self.target, self.keepalive_s = listen, target, keepalive_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"forward-{listen[1]}", daemon=True)
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.StreamWriter] = set()
        self.accepted = 0

    def start(self) -> "TcpForwarder":
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, *self.listen), self.loop).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            for writer in list(self.connections):
                writer.transport.abort()
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def _probe(self, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is None or self.keepalive_s is None:
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.keepalive_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._probe(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self.connections -= {writer, up_writer}

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()  # one side gone (closed, reset, or its keepalive failed): both go
