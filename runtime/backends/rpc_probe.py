"""Talking to llama.cpp RPC servers before llama.cpp does: endpoints, and each server's
protocol version and device memory, asked with a timeout.

llama.cpp's own client aborts the process when a server cannot be reached or answers
with another protocol version, and waits forever on a server busy with another client
(it serves one at a time). :func:`query_server` speaks the first three commands of the
protocol itself (HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY: one command byte, an 8-byte
size and the payload; the answer an 8-byte size and the data), so each of those cases
is one clear :class:`RpcError` naming the server.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from tandem.errors import TandemError
from tandem.runtime.backends.rpc_split import RemoteDevice

DEFAULT_PORT = 50052
RPC_PROTO_MAJOR = 7
"""``RPC_PROTO_MAJOR_VERSION`` of the llama.cpp this package is built with (ggml-rpc.h;
tests/runtime/backends/test_rpc.py checks it against the server's banner)."""
_HELLO, _DEVICE_COUNT, _GET_DEVICE_MEMORY = 14, 15, 11
_CAPS = 24
PROBE_TIMEOUT = 5.0


class RpcError(TandemError):
    """An RPC server cannot be used: unreachable, busy, or another protocol version."""


class RpcPeerLost(TandemError):
    """An RPC server stopped answering while the model was in use."""


# -- endpoints and the server's own answers --------------------------------------------
def parse_endpoints(spec: str | Sequence[str]) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT...]`` (or a sequence of them) as normalized endpoints; a
    bare host gets :data:`DEFAULT_PORT`."""
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in s.split(",")]
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(DEFAULT_PORT)
        if not host or ":" in host or host.startswith("["):
            raise RpcError(f"Cannot read the RPC server {item!r}: write HOST:PORT (llama.cpp's RPC "
                           "client takes host names and IPv4 addresses, not IPv6).")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise RpcError(f"The RPC server {item!r} needs a port between 1 and 65535.")
        endpoint = f"{host}:{int(port)}"
        if endpoint in out:
            raise RpcError(f"The RPC server {endpoint} is listed twice.")
        out.append(endpoint)
    if not out:
        raise RpcError("--rpc needs at least one HOST:PORT.")
    return tuple(out)


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def _command(sock: socket.socket, cmd: int, payload: bytes, answer: int) -> bytes:
    """One request (command byte, 8-byte size, payload) and its answer (8-byte size,
    data), as llama.cpp's RPC protocol frames them."""
    sock.sendall(bytes([cmd]) + struct.pack("<Q", len(payload)) + payload)
    head = _read(sock, 8)
    (size,) = struct.unpack("<Q", head)
    if size != answer:
        raise ValueError(f"answer of {size} bytes to command {cmd}, expected {answer}")
    return _read(sock, size)


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ValueError("connection closed")
        data += chunk
    return data


def query_server(endpoint: str, timeout: float = PROBE_TIMEOUT) -> tuple[RemoteDevice, ...]:
    """The devices an RPC server offers with their free and total memory, asked the way
    llama.cpp's client asks, but with a timeout and a clear error for each way it fails."""
    host, port = _split(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        raise RpcError(f"Nothing listens at {endpoint}: start `tandem rpc-server --port {port}` on "
                       "that machine (or the SSH tunnel to it).") from None
    except OSError as exc:
        raise RpcError(f"Cannot reach the RPC server {endpoint}: {exc}.") from None
    with sock:
        try:
            hello = _command(sock, _HELLO, bytes(_CAPS), 4 + _CAPS)
            major, minor = hello[0], hello[1]
            if major != RPC_PROTO_MAJOR:
                raise RpcError(
                    f"The RPC server {endpoint} speaks protocol {major}.{minor}, this build "
                    f"{RPC_PROTO_MAJOR}.x: run the same llama.cpp on both machines "
                    "(bash packaging/bootstrap.sh on each).")
            (count,) = struct.unpack("<I", _command(sock, _DEVICE_COUNT, b"", 4))
            devices = []
            for index in range(count):
                free, total = struct.unpack("<QQ", _command(sock, _GET_DEVICE_MEMORY, struct.pack("<I", index), 16))
                devices.append(RemoteDevice(endpoint, index, free, total))
        except TimeoutError:
            raise RpcError(
                f"The RPC server {endpoint} accepted the connection but did not answer within "
                f"{timeout:g} s: it serves one client at a time; is another tandem or llama.cpp "
                "using it?") from None
        except (ValueError, OSError) as exc:
            raise RpcError(f"{endpoint} does not answer as a llama.cpp RPC server of protocol "
                           f"{RPC_PROTO_MAJOR}.x ({exc}).") from None
    if not devices:
        raise RpcError(f"The RPC server {endpoint} offers no device.")
    return tuple(devices)


def reachable(endpoint: str, timeout: float = 2.0) -> bool:
    """Whether something still accepts connections at ``endpoint`` (a busy server does:
    the kernel queues the connection)."""
    try:
        socket.create_connection(_split(endpoint), timeout=timeout).close()
    except OSError:
        return False
    return True
