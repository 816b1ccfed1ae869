"""A target split over machines: llama.cpp's RPC backend, wired through its C API.

llama.cpp runs a model's layers on *devices*; an RPC server (``tandem rpc-server`` on
another machine) offers its CPU or GPUs as devices over TCP. llama-cpp-python's
``rpc_servers`` option predates llama.cpp's device registry and no longer works
(abetlen/llama-cpp-python#1914), so this module does what llama.cpp's own ``--rpc`` does,
through ctypes: ``ggml_backend_rpc_add_server`` for each server, then the devices it
reports go into ``llama_model_params.devices`` with a ``tensor_split`` that puts the
planned number of blocks on each (:mod:`tandem.runtime.planning.rpc_devices`). The
token embedding, the first blocks and the output head stay on this machine (a
buffer-type override pins the head here), so a decode step sends one hidden-state row
per server, never a row of logits. The drafter is an ordinary local model.

Failures. llama.cpp's RPC client aborts the process when a server cannot be reached or
stops answering mid-call (``GGML_ABORT`` in ggml-rpc.cpp). So:

* before llama.cpp connects, each server is asked its protocol version and device
  memory by :func:`query_server` (our own few bytes of its protocol, with a timeout):
  nothing listening, a busy server (it serves one client at a time), an older protocol
  or a non-RPC port is a :class:`RpcError` naming the server, not an abort or a hang;
* every native call that talks to a server (model load, context creation, decode, free)
  runs on a worker thread (:class:`RpcLink`). ggml's abort callback, called on
  llama.cpp's dispatcher thread when a peer is lost, records the loss and parks that
  thread instead of returning into ``abort()``; the caller, waiting on the worker, raises
  :class:`RpcPeerLost` and the reply ends with its text so far. A call that gets no
  answer for ``TANDEM_RPC_TIMEOUT`` seconds (default 120; a peer that vanished without
  closing its connection) ends the same way. The lost model cannot be used or freed
  (its buffers live on the dead peer and its threads stay parked): it is abandoned,
  and that server cannot be used again in this process (restart tandem to reconnect).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp

from tandem.models.errors import TandemError
from tandem.models.gguf_file import GGUFInfo
from tandem.runtime.planning.rpc_devices import (
    LOCAL_HEADROOM,
    RemoteDevice,
    RpcSplit,
    available_here,
    pinned_split,
    plan_split,
)
from tandem.runtime.planning.shapes import shape_from_gguf

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


# -- ggml's C API ------------------------------------------------------------------------
class _TensorOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


OUTPUT_ON_HOST = rb"^(output|output_norm|token_embd)\."
"""Tensors pinned to this machine: the output head (and the embedding a tied head
duplicates), so logits are computed where they are read."""


class _Ggml:
    """The few ggml functions used here, from the libraries llama_cpp loaded."""

    def __init__(self) -> None:
        lib = Path(llama_cpp.__file__).parent / "lib"
        base, rpc = self._loaded(lib, "ggml-base"), self._loaded(lib, "ggml-rpc")
        if rpc is None or base is None:
            raise RpcError("This llama.cpp build has no RPC backend: rebuild it with "
                           "bash packaging/bootstrap.sh (packaging/cpu_flags.sh adds -DGGML_RPC=ON).")
        p, c = ctypes.c_void_p, ctypes.c_char_p
        self.add_server = self._fn(rpc, "ggml_backend_rpc_add_server", p, [c])
        self.reg_dev_count = self._fn(base, "ggml_backend_reg_dev_count", ctypes.c_size_t, [p])
        self.reg_dev_get = self._fn(base, "ggml_backend_reg_dev_get", p, [p, ctypes.c_size_t])
        self.cpu_buffer_type = self._fn(base, "ggml_backend_cpu_buffer_type", p, [])
        self.set_abort_callback = self._fn(base, "ggml_set_abort_callback", p, [p])

    @staticmethod
    def _loaded(lib: Path, name: str) -> ctypes.CDLL | None:
        """The copy of ``lib<name>`` libllama is linked with. The wheel ships each library
        three times (``.so``, ``.so.0``, ``.so.0.x.y``, copies, not links) and the loader
        resolves libllama's dependencies by soname, so opening another copy would give a
        second ggml with its own globals (its abort callback would never be called)."""
        for candidate in (f"lib{name}.so.0", f"lib{name}.0.dylib", f"lib{name}.so", f"lib{name}.dylib"):
            if (lib / candidate).exists():
                return ctypes.CDLL(str(lib / candidate))
        return None

    @staticmethod
    def _fn(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
        return fn


_ABORT_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


class _Losses:
    """What ggml's abort callback saw: RPC failures are recorded (and their thread parked,
    so ``abort()`` never runs); any other abort is printed and goes ahead."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.messages: list[str] = []
        self.endpoints: set[str] = set()
        self._callback = _ABORT_FN(self._on_abort)
        self._installed = False

    def install(self, ggml: _Ggml) -> None:
        if not self._installed:
            ggml.set_abort_callback(ctypes.cast(self._callback, ctypes.c_void_p))
            self._installed = True

    def _on_abort(self, message: bytes | None) -> None:
        text = (message or b"").decode("utf-8", "replace")
        if "ggml-rpc" not in text:
            os.write(2, (text + "\n").encode())
            return
        self.messages.append(text.split(": ", 1)[-1].strip())
        self.event.set()
        threading.Event().wait()  # park llama.cpp's thread for good: returning would abort()


LOSSES = _Losses()
_ggml: _Ggml | None = None


def ggml() -> _Ggml:
    global _ggml
    if _ggml is None:
        _ggml = _Ggml()
        LOSSES.install(_ggml)
    return _ggml


def direct(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a native call in this thread (a model without RPC devices)."""
    return fn(*args)


# -- one model's link to its servers ---------------------------------------------------------
class _Job:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class RpcLink:
    """The RPC devices of one model and the worker thread its native calls run on."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float | None = None) -> None:
        self.endpoints = tuple(endpoints)
        for endpoint in self.endpoints:
            if endpoint in LOSSES.endpoints:
                raise RpcError(f"The RPC server {endpoint} was lost earlier in this process; "
                               "restart tandem to connect to it again.")
        self.remote: tuple[RemoteDevice, ...] = tuple(d for e in self.endpoints for d in query_server(e))
        self.timeout = timeout if timeout is not None else float(os.environ.get("TANDEM_RPC_TIMEOUT", "120"))
        self.lost: str | None = None
        self._ggml = ggml()
        self._jobs: list[_Job] = []
        self._wake = threading.Condition()
        threading.Thread(target=self._work, name="tandem-rpc", daemon=True).start()
        self._devices: list[int] = []
        for endpoint in self.endpoints:
            reg = self.call(self._ggml.add_server, endpoint.encode())
            if not reg:
                raise RpcError(f"llama.cpp could not register the RPC server {endpoint}.")
            self._devices += [self._ggml.reg_dev_get(reg, i) for i in range(self._ggml.reg_dev_count(reg))]
        self._keep: list[Any] = []

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait()
                job = self._jobs.pop(0)
            try:
                job.result = job.fn(*job.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                job.error = exc
            job.done.set()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """``fn(*args)`` on the worker; :class:`RpcPeerLost` if a server is lost (or
        nothing comes back within ``timeout`` seconds) first."""
        if self.lost:
            raise RpcPeerLost(self.lost)
        job = _Job(fn, args)
        with self._wake:
            self._jobs.append(job)
            self._wake.notify()
        waited, interrupted = 0.0, None
        seen = len(LOSSES.messages)
        while not job.done.is_set():
            try:
                if job.done.wait(0.05):
                    break
            except KeyboardInterrupt as exc:  # as a native call: the interrupt lands after it
                interrupted = exc
            waited += 0.05
            if len(LOSSES.messages) > seen:  # an RPC abort somewhere: probe our servers once
                seen = len(LOSSES.messages)
                if self._lose_dead():
                    raise RpcPeerLost(self.lost)
            if timeout is not None and waited > timeout:
                self._lose(f"no answer from the RPC servers ({', '.join(self.endpoints)}) for {timeout:g} s",
                           self.endpoints)
                raise RpcPeerLost(self.lost)
        if interrupted is not None:
            raise interrupted
        if job.error is not None:
            raise job.error
        return job.result

    def _lose_dead(self) -> bool:
        """After an RPC abort somewhere in the process: is one of this model's servers gone?"""
        dead = [e for e in self.endpoints if not reachable(e)]
        if dead:
            self._lose(f"{', '.join(dead)} stopped answering ({'; '.join(LOSSES.messages) or 'connection lost'})", dead)
        return bool(dead)

    def _lose(self, why: str, endpoints: Sequence[str]) -> None:
        """Mark this model unusable, and ``endpoints`` for the rest of the process: their
        llama.cpp connection is parked, and llama.cpp would hand it to a new model."""
        self.lost = (f"Lost the RPC server: {why}. The reply stops here; the model split over "
                     "it cannot be used again in this process (restart tandem after restarting the server).")
        LOSSES.endpoints.update(endpoints)

    def decode(self, ctx: Any, batch: Any) -> int:
        """``llama_decode`` plus the wait for its outputs, both of which talk to servers."""
        def run() -> int:
            rc = llama_cpp.llama_decode(ctx, batch)
            llama_cpp.llama_synchronize(ctx)
            return rc

        return self.call(run, timeout=self.timeout)

    def apply(self, params: llama_cpp.llama_model_params, split: RpcSplit) -> None:
        """Put ``split``'s blocks on the RPC devices and keep the output head here."""
        counts = list(split.remote_layers)
        if len(counts) != len(self._devices):
            raise RpcError(f"The split names {len(counts)} RPC devices, the servers offer {len(self._devices)}.")
        if len(counts) >= llama_cpp.LLAMA_MAX_DEVICES:
            raise RpcError(f"llama.cpp takes at most {llama_cpp.LLAMA_MAX_DEVICES - 1} RPC devices.")
        devices = (ctypes.c_void_p * (len(counts) + 1))(*self._devices, None)
        # Offloading counts from the last layer and the output head is layer n_layer: ask
        # for one more and pin the head here with the override; it rides on the last device.
        counts[-1] += 1
        shares = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*map(float, counts))
        overrides = (_TensorOverride * 2)(_TensorOverride(OUTPUT_ON_HOST, self._ggml.cpu_buffer_type()),
                                          _TensorOverride(None, None))
        self._keep += [devices, shares, overrides]
        params.devices = ctypes.addressof(devices)
        params.tensor_split = ctypes.cast(shares, ctypes.POINTER(ctypes.c_float))
        params.tensor_buft_overrides = ctypes.addressof(overrides)
        params.n_gpu_layers = sum(split.remote_layers) + 1

    def release(self, context: Any, model: Any) -> None:
        """Free a llama-cpp-python context and model on the worker; after a loss, abandon
        them instead (freeing would wait on the dead server for good) by clearing their
        native pointers, which their ``close`` and ``__del__`` then skip."""
        if self.lost is None:
            try:
                self.call(context.close, timeout=self.timeout)
                self.call(model.close, timeout=self.timeout)
                return
            except RpcPeerLost:
                pass
        context.ctx = None
        model.model = None


def open_link(endpoints: Sequence[str], info: GGUFInfo, *, n_ctx: int, n_batch: int, type_k: str = "f16",
              type_v: str = "f16", layers: Sequence[int] = ()) -> tuple[RpcLink, RpcSplit]:
    """Connect to the servers and split the model over them: ``layers`` (this machine
    first, then each RPC device) when given, else planned from the memory each reports
    and this machine's budget."""
    link = RpcLink(parse_endpoints(endpoints))
    shape = shape_from_gguf(info)
    if layers:
        return link, pinned_split(shape, layers, link.remote)
    local = int(available_here() * LOCAL_HEADROOM)
    return link, plan_split(shape, link.remote, local_available=local, n_ctx=n_ctx, n_batch=n_batch,
                            type_k=type_k, type_v=type_v)
