"""A target split over machines: llama.cpp's RPC backend, wired through its C API.

llama.cpp runs a model's layers on *devices*; an RPC server (``tandem rpc-server`` on
another machine) offers its CPU or GPUs as devices over TCP. llama-cpp-python's
``rpc_servers`` option predates llama.cpp's device registry and no longer works
(abetlen/llama-cpp-python#1914), so this module does what llama.cpp's own ``--rpc`` does,
through ctypes: ``ggml_backend_rpc_add_server`` for each server, then the devices it
reports go into ``llama_model_params.devices`` with a ``tensor_split`` that puts the
planned number of blocks on each (priced by :mod:`tandem.runtime.planning.rpc_devices`). The
token embedding, the first blocks and the output head stay on this machine (a
buffer-type override pins the head here), so a decode step sends one hidden-state row
per server, never a row of logits. The drafter is an ordinary local model.

Failures. llama.cpp's RPC client aborts the process when a server cannot be reached or
stops answering mid-call (``GGML_ABORT`` in ggml-rpc.cpp). So:

* before llama.cpp connects, each server is asked its protocol version and device
  memory by :func:`~tandem.runtime.backends.rpc_probe.query_server` (our own few bytes
  of its protocol, with a timeout):
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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp

from tandem.models.gguf_file import GGUFInfo
from tandem.runtime.backends.ggml_lib import loaded
from tandem.runtime.backends.rpc_probe import (
    RpcError,
    RpcPeerLost,
    parse_endpoints,
    query_server,
    reachable,
)
from tandem.runtime.backends.rpc_split import RemoteDevice, RpcSplit, pinned_split


# -- ggml's C API ------------------------------------------------------------------------
class _TensorOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


OUTPUT_ON_HOST = rb"^(output|output_norm|token_embd)\."
"""Tensors pinned to this machine: the output head (and the embedding a tied head
duplicates), so logits are computed where they are read."""


class _Ggml:
    """The few ggml functions used here, from the libraries llama_cpp loaded."""

    def __init__(self) -> None:
        base, rpc = loaded("ggml-base"), loaded("ggml-rpc")
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
    def _fn(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
        return fn


_ABORT_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


class _Losses:
    """What ggml's abort callback saw: RPC failures are recorded (and their thread parked,
    so ``abort()`` never runs); any other abort is printed and goes ahead."""

    def __init__(self) -> None:
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
    def __init__(self, fn: Callable[..., Any] | None, args: tuple[Any, ...]) -> None:
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
            if job.fn is None:  # released: nothing more will come
                return
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
        start, interrupted = time.monotonic(), None
        seen = len(LOSSES.messages)
        while not job.done.is_set():
            try:
                if job.done.wait(0.05):
                    break
            except KeyboardInterrupt as exc:  # as a native call: the interrupt lands after it
                interrupted = exc
            if len(LOSSES.messages) > seen:  # an RPC abort somewhere: probe our servers once
                seen = len(LOSSES.messages)
                if self._lose_dead():
                    raise RpcPeerLost(self.lost)
            if timeout is not None and time.monotonic() - start > timeout:
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
                with self._wake:  # end the worker
                    self._jobs.append(_Job(None, ()))
                    self._wake.notify()
                return
            except RpcPeerLost:
                pass
        context.ctx = None
        model.model = None


def open_link(endpoints: Sequence[str], info: GGUFInfo, layers: Sequence[int]) -> tuple[RpcLink, RpcSplit]:
    """Connect to the servers and split the model over them: ``layers`` blocks on this
    machine, then on each RPC device (the planner's split:
    :func:`tandem.runtime.planning.rpc_devices.plan_remote`)."""
    if not layers:
        raise RpcError("An RPC split needs its layers per device (LlamaConfig.rpc_layers): "
                       "plan them with tandem.runtime.planning.rpc_devices.plan_remote.")
    link = RpcLink(parse_endpoints(endpoints))
    return link, pinned_split(int(info.arch_value("block_count", 0) or 0), layers, link.remote)
