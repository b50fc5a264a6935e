"""The one way out of a local sandbox's network namespace: a listener on 127.0.0.1:PORT *inside* the namespace whose
connections are relayed to 127.0.0.1:PORT on the host (the adapter's port). Nothing else is routed: the namespace
has only its loopback interface.

The listening socket is made by a short-lived thread that enters the sandbox's network namespace (setns affects
only the calling thread), binds, and returns the socket; the relaying runs on the caller's event loop, whose thread
stays in the host's namespace.

What it is not: a proxy that looks at the traffic, or a way to reach other host ports.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import threading

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def listen_in_namespace(netns_path: str, port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1:`port` in the network namespace at `netns_path` (/proc/PID/ns/net)."""
    result: dict = {}

    def make() -> None:
        target = os.open(netns_path, os.O_RDONLY)
        try:
            # this thread only, and it ends right after: the event loop's thread stays in the host's namespace
            if _libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns_path}")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            sock.setblocking(False)
            result["socket"] = sock
        except OSError as e:  # handed to the caller's thread
            result["error"] = e
        finally:
            os.close(target)

    thread = threading.Thread(target=make, name="sandbox-netns-listen")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["socket"]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            writer.write_eof()
        except (OSError, RuntimeError):
            writer.close()


class LoopbackForward:
    """Relay connections made inside the sandbox to 127.0.0.1:`port` to the host's 127.0.0.1:`port`."""

    def __init__(self, netns_path: str, port: int) -> None:
        self.netns_path = netns_path
        self.port = port
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        sock = listen_in_namespace(self.netns_path, self.port)
        self._server = await asyncio.start_server(self._relay, sock=sock)

    async def _relay(self, inside_reader: asyncio.StreamReader, inside_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            host_reader, host_writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            inside_writer.close()
            return
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await asyncio.gather(_pump(inside_reader, host_writer), _pump(host_reader, inside_writer))
        finally:
            self._tasks.discard(task)
            for writer in (inside_writer, host_writer):
                writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
