"""A target split over llama.cpp RPC servers, with and without a local drafter.

Two ``tandem-rpc-server`` processes on loopback stand in for two other machines; a
:class:`DelayProxy` in front of each adds a one-way delay to every byte in both
directions (a LAN's latency, without its bandwidth limit). The Qwen2.5-Coder 1.5B
target is split over this process and both servers; every configuration decodes the
same prompts greedily, alternating in one process, and reports the median tokens/s:

* ``plain``: plain RPC decoding, one call (one trip through both servers) per token;
* ``model-auto``: + the 0.5B drafter (local), adaptive draft length, model-free sources;
* ``model@K``: + the 0.5B drafter, fixed draft length K;
* ``ngram``: model-free drafting only (suffix tree + prompt lookup), adaptive;
* ``local`` (not by default): plain decoding of the whole model in this process.

Every speculative configuration must reproduce plain decoding token for token.

    python -m benchmarks.rpc [--delays 0,1,5] [--tokens 64] [--rounds 3] [--threads 1]
    python -m benchmarks.rpc --cost [--delays 0,1,5,20]      # c(k) through the servers

The helpers here (:class:`DelayProxy`, :func:`rpc_servers`) are also the test fixtures
of tests/runtime/backends/test_rpc.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SERVER = Path(sys.executable).parent / "tandem-rpc-server"
REAL = Path(os.path.expanduser("~/.cache/tandem-real-models"))


# -- a loopback proxy that delays ------------------------------------------------------
class DelayProxy:
    """Forward ``127.0.0.1:port`` to ``upstream``, delivering every chunk ``delay_s``
    after it arrived, in each direction. Chunks are timestamped on arrival and sent by
    a second thread when due, so the delay does not throttle throughput."""

    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream, self.delay_s = upstream, delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._closed = False
        self._flowing = threading.Event()
        self._flowing.set()
        threading.Thread(target=self._accept, name="delay-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:
                return
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [client, server]
            for src, dst in ((client, server), (server, client)):
                chunks: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(src, dst, chunks), daemon=True).start()
                threading.Thread(target=self._send, args=(dst, chunks), daemon=True).start()

    def _read(self, src: socket.socket, dst: socket.socket, chunks: queue.Queue) -> None:
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            chunks.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    def _send(self, dst: socket.socket, chunks: queue.Queue) -> None:
        while True:
            due, data = chunks.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._flowing.wait()
            try:
                if not data:  # the other side closed: close this one too
                    dst.shutdown(socket.SHUT_RDWR)
                    return
                dst.sendall(data)
            except OSError:
                return

    def stall(self) -> None:
        """Stop delivering, connections left open: a peer that vanished without closing
        them (a cable pulled, a laptop asleep)."""
        self._flowing.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


# -- rpc-server processes --------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Until something accepts on ``port`` (the server's banner line comes first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc server on port {port} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"rpc server on port {port} did not listen within {timeout:g} s")


@dataclass
class Servers:
    """Running servers (and their proxies): ``endpoints`` are what a client connects to."""

    procs: list[subprocess.Popen]
    proxies: list[DelayProxy] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)

    @property
    def endpoints(self) -> tuple[str, ...]:
        if self.proxies:
            return tuple(p.endpoint for p in self.proxies)
        return tuple(f"127.0.0.1:{p}" for p in self.ports)


@contextlib.contextmanager
def rpc_servers(n: int = 2, *, threads: int = 1, delay_ms: float = 0.0, mem_mib: int | None = None,
                binary: Path = SERVER) -> Iterator[Servers]:
    """``n`` ``tandem-rpc-server`` processes on loopback (behind delay proxies when
    ``delay_ms`` > 0), stopped on exit."""
    procs: list[subprocess.Popen] = []
    ports: list[int] = []
    proxies: list[DelayProxy] = []
    try:
        for _ in range(n):
            port = free_port()
            cmd = [str(binary), "--port", str(port), "--threads", str(threads)]
            cmd += ["--mem", str(mem_mib)] if mem_mib else []
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ports.append(port)
        for port, proc in zip(ports, procs, strict=True):
            wait_listening(port, proc)
        if delay_ms > 0:
            proxies += [DelayProxy(("127.0.0.1", p), delay_ms / 1000) for p in ports]
        yield Servers(procs, proxies, ports)
    finally:
        for proxy in proxies:
            proxy.close()
        for proc in procs:
            proc.kill()
            proc.wait()


# -- the benchmark -----------------------------------------------------------------------
CONFIGS = ("plain", "model-auto", "model@4", "ngram")


def _strategy(name: str, target, draft: Path, threads: int):
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    if name == "plain":
        return build_strategy(target, None, SpecOptions(mode="off"))
    if name == "ngram":
        return build_strategy(target, None, SpecOptions(mode="ngram", suffix_memory="request"))
    k = int(name.split("@")[1]) if "@" in name else None
    return build_strategy(target, draft, SpecOptions(mode="auto" if k is None else "model", draft_length=k,
                                                     suffix_memory="request"),
                          llama_config=LlamaConfig(n_ctx=target.n_ctx, n_threads=threads))


def _decode(target, prompt: list[int], strategy, tokens: int):
    """Greedy ids and the run's stats (decode speed: tokens after the first over the time
    after the first, as ``tandem run`` reports it)."""
    from tandem.kernels.sampling import Sampler
    from tandem.kernels.sampling_params import SamplingParams
    from tandem.runtime.generate import DoneEvent, generate

    target.truncate(0)
    done = [e for e in generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                                max_tokens=tokens, stop_at_eog=False) if isinstance(e, DoneEvent)][0]
    return done.tokens, done.stats


def bench_delay(delay_ms: float, *, target_path: Path, draft_path: Path, threads: int, tokens: int,
                rounds: int, layers: tuple[int, ...], configs: tuple[str, ...]) -> dict:
    from tandem.app.bench.workloads import workload
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    with rpc_servers(2, threads=threads, delay_ms=delay_ms) as servers:
        target = LlamaCppBackend(target_path, LlamaConfig(n_ctx=1024, n_threads=threads, rpc=servers.endpoints,
                                                          rpc_layers=layers))
        try:
            prompts = workload(target, "codegen", 1).prompts + workload(target, "edit", 1).prompts
            # "local": plain decoding of the whole model in this process (what splitting costs)
            local = (LlamaCppBackend(target_path, LlamaConfig(n_ctx=1024, n_threads=threads))
                     if "local" in configs else None)
            targets = {c: local if c == "local" else target for c in configs}
            strategies = {c: _strategy("plain" if c == "local" else c, targets[c], draft_path, threads)
                          for c in configs}
            speeds: dict[str, list[float]] = {c: [] for c in configs}
            per_call: dict[str, list[float]] = {c: [] for c in configs}
            accepted: dict[str, list[float]] = {c: [] for c in configs}
            reference: dict[int, list[int]] = {}
            for _ in range(rounds):
                for i, prompt in enumerate(prompts):
                    for name in configs:  # alternating, so load and heat hit every configuration alike
                        ids, stats = _decode(targets[name], prompt, strategies[name], tokens)
                        reference.setdefault(i, ids)
                        if ids != reference[i]:
                            raise AssertionError(f"{name} at {delay_ms} ms differs from plain decoding")
                        speeds[name].append(stats.tokens_per_s)
                        per_call[name].append(stats.tokens_per_call)
                        if stats.acceptance_rate is not None:
                            accepted[name].append(stats.acceptance_rate)
            for s in strategies.values():
                s.close()
            if local is not None:
                local.close()
        finally:
            target.close()
    plain = statistics.median(speeds["plain"]) if "plain" in speeds else None
    return {"load_average_end": round(os.getloadavg()[0], 2)} | {name: {"tokens_per_s": round(statistics.median(v), 2),
                   "speedup": round(statistics.median(v) / plain, 2) if plain else None,
                   "tokens_per_call": round(statistics.median(per_call[name]), 2),
                   "acceptance": round(statistics.median(accepted[name]), 2) if accepted[name] else None,
                   "runs": [round(x, 2) for x in v]} for name, v in speeds.items()}


def cost_curve(delay_ms: float, *, target_path: Path, threads: int, layers: tuple[int, ...],
               ks: tuple[int, ...] = (0, 1, 2, 4, 6), reps: int = 5) -> dict:
    """Seconds of one target call over k+1 positions through the servers (median of
    ``reps``, the k's interleaved), and c(k) = that over the one-token call."""
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    with rpc_servers(2, threads=threads, delay_ms=delay_ms) as servers, LlamaCppBackend(
            target_path, LlamaConfig(n_ctx=512, n_threads=threads, rpc=servers.endpoints, rpc_layers=layers)) as target:
        context = target.tokenize("def merge_intervals(intervals):\n    " * 6)
        times: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(reps):
            for k in ks:
                target.truncate(0)
                target.evaluate(context)
                start = time.perf_counter()
                target.evaluate(context[: k + 1])
                times[k].append(time.perf_counter() - start)
    t = {k: statistics.median(v) for k, v in times.items()}
    return {"call_ms": {k: round(1000 * v, 1) for k, v in t.items()},
            "c": {k: round(v / t[ks[0]], 2) for k, v in t.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=REAL / "qwen2.5-coder-1.5b.gguf")
    ap.add_argument("--draft", type=Path, default=REAL / "qwen2.5-coder-0.5b.gguf")
    ap.add_argument("--delays", default="0,1,5", help="one-way delays in ms")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads of each process (this one and each server)")
    ap.add_argument("--layers", default="10,9,9", help="blocks here, on server 1, on server 2")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--cost", action="store_true", help="measure c(k) through the servers instead")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    layers = tuple(int(x) for x in args.layers.split(","))
    if args.cost:
        for delay in (float(d) for d in args.delays.split(",")):
            r = cost_curve(delay, target_path=args.target, threads=args.threads, layers=layers)
            print(f"one-way delay {delay:g} ms (load average {os.getloadavg()[0]:.1f}): call ms {r['call_ms']}, "
                  f"c(k) {r['c']}", flush=True)
        return 0
    configs = tuple(args.configs.split(","))
    results = {}
    for delay in (float(d) for d in args.delays.split(",")):
        results[f"{delay:g}ms"] = bench_delay(delay, target_path=args.target, draft_path=args.draft,
                                              threads=args.threads, tokens=args.tokens, rounds=args.rounds,
                                              layers=layers, configs=configs)
        r = results[f"{delay:g}ms"]
        print(f"one-way delay {delay:g} ms (load average {os.getloadavg()[0]:.1f}):", flush=True)
        for name in configs:
            print(f"  {name:11s} {r[name]['tokens_per_s']:6.2f} tok/s  x{r[name]['speedup']:<5} "
                  f"{r[name]['tokens_per_call']:.2f} tokens/call, acceptance {r[name]['acceptance']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"target": str(args.target), "draft": str(args.draft),
                                                               "json": str(args.json)}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
