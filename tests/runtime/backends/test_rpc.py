"""A target split over llama.cpp RPC servers: two ``tandem-rpc-server`` processes on
loopback (one behind a proxy that delays every byte 1 ms each way, as a LAN would) stand
in for two other machines. Real Qwen2.5-Coder 0.5B, a few tokens: this runs in CI on
2 cores."""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import IN_CI
from greedy_runs import greedy_rows

from benchmarks.rpc import SERVER, DelayProxy, free_port, wait_listening
from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.rpc_probe import (
    RPC_PROTO_MAJOR,
    RpcError,
    RpcPeerLost,
    parse_endpoints,
    query_server,
)
from tandem.runtime.generate import TokenEvent, generate
from tandem.runtime.planning.rpc_devices import plan_remote
from tandem.runtime.speculative.factory import SpecOptions, build_strategy

MiB = 2**20
PROMPT = ("<|im_start|>user\nWrite a Python function that parses a CSV file and returns the rows "
          "as dictionaries.<|im_end|>\n<|im_start|>assistant\n")
N_TOKENS = 10
MEM = (400, 800)
"""MiB the two module servers offer (``--mem``): the planner must follow them."""


@pytest.fixture(scope="module")
def server_binary() -> Path:
    if not SERVER.exists():
        message = f"{SERVER} is not built (bash packaging/bootstrap.sh builds it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return SERVER


def start_server(binary: Path, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([str(binary), "--port", str(port), "--threads", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_listening(port, proc)
    return proc, port


@pytest.fixture(scope="module")
def servers(server_binary: Path):
    """Two servers offering 400 and 800 MiB; the first behind a 1 ms (one-way) proxy."""
    procs, ports = zip(*(start_server(server_binary, "--mem", str(m)) for m in MEM), strict=True)
    proxy = DelayProxy(("127.0.0.1", ports[0]), 0.001)
    yield (proxy.endpoint, f"127.0.0.1:{ports[1]}"), procs
    proxy.close()
    for proc in procs:
        proc.kill()
        proc.wait()


def test_parse_endpoints() -> None:
    assert parse_endpoints("a:1, b:2") == ("a:1", "b:2")
    assert parse_endpoints(["10.0.0.2"]) == ("10.0.0.2:50052",)
    for bad in ("a:0", "a:x", "[::1]:5", "a:1,a:1", ""):
        with pytest.raises(RpcError):
            parse_endpoints(bad)


def test_servers_report_the_memory_they_offer(servers) -> None:
    endpoints, _ = servers
    devices = [query_server(e) for e in endpoints]
    assert [(d[0].free, d[0].total) for d in devices] == [(m * MiB, m * MiB) for m in MEM]


@pytest.fixture
def fresh_servers(server_binary: Path):
    """Servers for one test (the module ones stay untouched)."""
    started = [start_server(server_binary) for _ in range(2)]
    yield [f"127.0.0.1:{port}" for _, port in started], [proc for proc, _ in started]
    for proc, _ in started:
        proc.kill()
        proc.wait()


def test_server_speaks_the_protocol_the_client_expects(fresh_servers) -> None:
    endpoints, procs = fresh_servers
    (device,) = query_server(endpoints[0])
    assert 0 < device.free <= device.total  # MemAvailable, not all of RAM as llama.cpp's own server says
    procs[0].kill()
    banner = procs[0].communicate(timeout=30)[0]
    assert f"Starting RPC server v{RPC_PROTO_MAJOR}." in banner, banner


def test_unusable_servers_are_clear_errors(fresh_servers) -> None:
    endpoints, _ = fresh_servers
    with pytest.raises(RpcError, match="Nothing listens"):
        query_server(f"127.0.0.1:{free_port()}")
    # llama.cpp's server serves one client at a time: a second one waits, and is told why
    with socket.create_connection(("127.0.0.1", int(endpoints[0].split(":")[1]))) as busy:
        busy.sendall(bytes([14]) + (24).to_bytes(8, "little") + bytes(24))
        busy.recv(8)
        with pytest.raises(RpcError, match="one client at a time"):
            query_server(endpoints[0], timeout=0.5)
    # something else on the port: not an abort of this process, one line naming it
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        threading.Thread(target=lambda: other.accept()[0].close(), daemon=True).start()
        with pytest.raises(RpcError, match="does not answer as a llama.cpp RPC server"):
            query_server(f"127.0.0.1:{port}")


def test_greedy_output_through_rpc_equals_the_local_run(real_models, servers) -> None:
    endpoints, _ = servers
    with LlamaCppBackend(real_models.qwen_05b, LlamaConfig(n_ctx=256, n_threads=1)) as local:
        prompt = local.tokenize(PROMPT, special=True)
        expected, expected_rows = greedy_rows(local, prompt, N_TOKENS)
    config = LlamaConfig(n_ctx=256, n_threads=1, rpc=endpoints, rpc_layers=(8, 8, 8))
    with LlamaCppBackend(real_models.qwen_05b, config) as split:
        got, rows = greedy_rows(split, prompt, N_TOKENS)
        assert got == expected
        assert np.array_equal(rows, expected_rows)  # the servers compute what this machine would
        # lossless speculation over RPC: fixed-length model-free drafts, verified in one call
        split.truncate(0)
        strategy = build_strategy(split, None, SpecOptions(mode="ngram", draft_length=3, suffix_memory="request"))
        try:
            events = list(generate(split, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                                   max_tokens=N_TOKENS, stop_at_eog=False))
        finally:
            strategy.close()
        assert [t for e in events if isinstance(e, TokenEvent) for t in e.tokens] == expected


def kv_layers(log: str, n_ctx: int, kv_per_token_layer: int) -> dict[str, int]:
    """Blocks per device, read from llama.cpp's log lines ``... KV buffer size = X MiB``."""
    out = {}
    for line in log.splitlines():
        if "KV buffer size" in line and line.startswith("llama_kv_cache:"):
            device = line.split(":", 1)[1].split("KV buffer")[0].strip()
            mib = float(line.split("=")[1].split()[0])
            out[device] = round(mib * MiB / (n_ctx * kv_per_token_layer))
    return out


def test_planner_splits_by_the_memory_each_server_reports(real_models, servers, monkeypatch, capfd) -> None:
    endpoints, _ = servers
    split, n_ctx = plan_remote(real_models.qwen_05b, endpoints, local_budget=900 * MiB, n_ctx=256, n_batch=256)
    assert sum(split.layers) == 24 and min(split.layers) > 0
    assert split.remote_layers[1] > split.remote_layers[0]  # 800 MiB offered against 400
    assert all(s.fits for s in split.shares)
    monkeypatch.setenv("TANDEM_LLAMA_LOG", "1")  # llama.cpp names each device's KV buffer
    capfd.readouterr()
    config = LlamaConfig(n_ctx=n_ctx, n_batch=256, n_threads=1, rpc=endpoints, rpc_layers=split.layers)
    with LlamaCppBackend(real_models.qwen_05b, config) as backend:
        log = capfd.readouterr().err
        per_layer = backend.kv_bytes_per_token // 24
        placed = kv_layers(log, n_ctx, per_layer)
        assert placed == {"CPU": split.local_layers,
                          f"RPC0[{endpoints[0]}]": split.remote_layers[0],
                          f"RPC0[{endpoints[1]}]": split.remote_layers[1]}, log[-3000:]
        backend.truncate(0)
        assert backend.evaluate(backend.tokenize("def f():"))[-1].shape == (backend.n_vocab,)


def test_planner_refuses_a_split_that_does_not_fit(real_models, servers) -> None:
    endpoints, _ = servers
    with pytest.raises(TandemError) as err:
        plan_remote(real_models.qwen_05b, endpoints, local_budget=200 * MiB, n_ctx=32768)
    message = str(err.value)
    assert "does not fit" in message and all(e in message for e in endpoints)


def test_a_lost_peer_ends_the_reply_with_a_clear_error(real_models, fresh_servers) -> None:
    endpoints, procs = fresh_servers
    config = LlamaConfig(n_ctx=256, n_threads=1, rpc=tuple(endpoints), rpc_layers=(8, 8, 8))
    backend = LlamaCppBackend(real_models.qwen_05b, config)
    prompt = backend.tokenize(PROMPT, special=True)
    received: list[int] = []
    with pytest.raises(RpcPeerLost, match=endpoints[1]) as err:
        for event in generate(backend, prompt, Sampler(SamplingParams.greedy_params()), max_tokens=64,
                              stop_at_eog=False):
            if isinstance(event, TokenEvent):
                received += event.tokens
                if len(received) == 3:
                    procs[1].kill()
    assert len(received) >= 3  # the reply so far was delivered before the error
    assert "restart" in str(err.value)
    with pytest.raises(RpcPeerLost):  # the model stays unusable, it does not hang
        backend.evaluate([received[-1]])
    backend.close()  # abandoned, not freed: freeing would wait on the dead peer
    with pytest.raises(RpcError, match="lost earlier"):
        LlamaCppBackend(real_models.qwen_05b, config)


def test_a_silent_peer_ends_the_reply_after_the_timeout(real_models, fresh_servers, monkeypatch) -> None:
    endpoints, _ = fresh_servers
    proxy = DelayProxy(("127.0.0.1", int(endpoints[1].split(":")[1])), 0.0)
    monkeypatch.setenv("TANDEM_RPC_TIMEOUT", "3")
    config = LlamaConfig(n_ctx=256, n_threads=1, rpc=(endpoints[0], proxy.endpoint), rpc_layers=(8, 8, 8))
    backend = LlamaCppBackend(real_models.qwen_05b, config)
    try:
        prompt = backend.tokenize(PROMPT, special=True)
        received: list[int] = []
        with pytest.raises(RpcPeerLost, match="no answer from the RPC servers .* for 3 s"):
            for event in generate(backend, prompt, Sampler(SamplingParams.greedy_params()), max_tokens=64,
                                  stop_at_eog=False):
                if isinstance(event, TokenEvent):
                    received += event.tokens
                    if len(received) == 2:
                        proxy.stall()
        assert len(received) >= 2
        backend.close()
    finally:
        proxy.close()
