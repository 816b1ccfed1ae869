"""The host's time per generated token, against a target whose device time is given.

On a GPU a one-token step of the 1.5B takes 2-4 ms (the 0.5B 1.5 ms), so what the Python
around it costs per token (sampling over a 151,936-float row, the speculative loop's
drafting, pricing and bookkeeping) is no longer lost in the noise of a CPU step: 0.3 ms
is a tenth of plain decoding's speed there, and a draft mode whose drafts fail runs
below plain. Here the target is :class:`FreeTarget`, a Backend whose ``evaluate`` hands
out precomputed rows of the real vocabulary's size and then waits (spinning, as a host
thread waits on a GPU stream) for as long as a call of that many tokens takes on the
device: ``--step-ms`` for one token, times c(k) of ``--curve`` (default: the 1.5B's, as
measured on the H200). So the ratio of a draft mode to plain is what a GPU user would
see with the host's Python as it is (*modeled*: the device times are given, the host's
are measured), and with ``--step-ms 0`` only the host's time is left. Two kinds of text:

- ``fresh``: each token is an independent random pick of 64, so drafts rarely hold: what the
  speculative loop costs when speculation does not pay (it should then cost little);
- ``repeat``: each token follows from the one before (a cycle of 64): drafts hold, and
  rounds commit several tokens.

    python -m benchmarks.host_overhead [--tokens 512] [--reps 5] [--step-ms 2.0] [--curve 1,1.07,...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.protocol import ComputeSettings, MemoryReport, SpecialTokens
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.cost import CostCurve
from tandem.runtime.speculative.factory import SpecOptions, build_strategy

N_VOCAB = 151_936
"""Qwen2.5's vocabulary: what each row the host reads is as long as."""
H200_CURVE = CostCurve((1.0, 1.07, 1.22, 1.41, 1.52, 1.64, 1.77, 1.89, 1.98), 0.0)
"""c(k) of the Qwen2.5-Coder-1.5B shape on the H200 (BENCHMARKS "Quantized GGUF on a GPU")."""


class FreeTarget:
    """A Backend whose calls cost handing out rows, then ``step_s · curve(k)`` for a call
    over ``k + 1`` tokens: ``n_rows`` random logits rows, each with its own argmax token;
    which row a position gets follows ``text``."""

    def __init__(self, text: str, step_s: float = 0.0, curve: CostCurve = H200_CURVE,
                 n_rows: int = 64, n_ctx: int = 8192, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self._rows = rng.standard_normal((n_rows, N_VOCAB), dtype=np.float32)
        self._argmax = self._rows.argmax(axis=1)
        self._row_of = {int(t): i for i, t in enumerate(self._argmax)}
        self._fresh = rng.integers(0, n_rows, n_ctx)
        """``fresh`` text: independent picks (a multiplicative hash of the position, used
        before, repeats runs a suffix tree learns: 1.86 tokens a call)."""
        self._text = text
        self._n_ctx = n_ctx
        self._tokens: list[int] = []
        self._step_s = step_s
        self._curve = curve
        self.device_s = 0.0
        """The device time its calls stood for, in all."""

    def row_at(self, position: int, token: int) -> int:
        """The logits row after ``token`` at ``position``."""
        if self._text == "repeat":
            return (self._row_of.get(token, 0) + 1) % len(self._rows)
        return int(self._fresh[position % len(self._fresh)])

    @property
    def n_vocab(self) -> int:
        return N_VOCAB

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def special(self) -> SpecialTokens:
        return SpecialTokens(bos=None, eos=None)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return [int(t) for t in self._argmax[: len(text.split())]]

    def token_bytes(self, token: int) -> bytes:
        return b"x"

    def chat_template(self) -> str | None:
        return None

    def evaluate(self, tokens: Sequence[int], logits_for: Sequence[int] | None = None) -> np.ndarray:
        start = len(self._tokens)
        self._tokens.extend(int(t) for t in tokens)
        wanted = [len(tokens) - 1] if logits_for is None else list(logits_for)
        rows = self._rows[[self.row_at(start + i, int(tokens[i])) for i in wanted]]
        if self._step_s:
            busy = self._step_s * self._curve(len(tokens) - 1)
            self.device_s += busy
            until = time.perf_counter() + busy
            while time.perf_counter() < until:  # a host thread waiting on its GPU stream spins
                pass
        return rows

    def truncate(self, n: int) -> None:
        del self._tokens[max(0, n):]

    def keep_spans(self, spans: Sequence[tuple[int, int]]) -> bool:
        return False

    exact_batch: int | None = None

    def memory(self) -> MemoryReport:
        return MemoryReport(weights=self._rows.nbytes, kv_cache=0)

    def compute_settings(self) -> ComputeSettings:
        return ComputeSettings(None, "free")

    def set_threads(self, n: int) -> bool:
        return False

    def close(self) -> None:
        self._tokens = []


@dataclass
class Run:
    us_per_token: float
    host_us_per_token: float
    """Less the device time the target's calls stood for."""
    tokens_per_call: float
    tokens: list[int]


def run(target: FreeTarget, mode: str, tokens: int) -> Run:
    """A greedy reply of ``tokens`` tokens, ``plain`` or in a draft mode of
    :func:`build_strategy` (model-free: ``ngram``), learning the target's costs as a
    first run on a new target does."""
    prompt = target.tokenize("a b c d e f g h")
    strategy = None if mode == "plain" else build_strategy(
        target, None, SpecOptions(mode=mode, measure_cost=False, suffix_memory="request"))
    target.truncate(0)
    device0 = target.device_s
    start = time.perf_counter()
    done = None
    for ev in generate(target, prompt, Sampler(SamplingParams(temperature=0.0)), max_tokens=tokens,
                       stop_at_eog=False, strategy=strategy or autoregressive):
        if isinstance(ev, DoneEvent):
            done = ev
    elapsed = time.perf_counter() - start
    if strategy is not None:
        strategy.close()
    assert done is not None
    n = len(done.tokens)
    return Run(elapsed / n * 1e6, (elapsed - (target.device_s - device0)) / n * 1e6, done.stats.tokens_per_call,
               list(done.tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=2.0, help="device time of a one-token call (0: none)")
    ap.add_argument("--curve", default=",".join(map(str, H200_CURVE.c)), help="c(0..8) of the device")
    args = ap.parse_args()
    curve = CostCurve(tuple(float(x) for x in args.curve.split(",")), args.step_ms / 1e3)
    print(f"device: {args.step_ms} ms a one-token call, c(k) {args.curve}")
    for text in ("fresh", "repeat"):
        target = FreeTarget(text, args.step_ms / 1e3, curve)
        runs: dict[str, list[Run]] = {"plain": [], "ngram": []}
        run(target, "ngram", 32)  # warm-up
        for _ in range(args.reps):
            for mode in runs:  # alternating
                runs[mode].append(run(target, mode, args.tokens))
        plain = statistics.median(r.us_per_token for r in runs["plain"])
        for mode, rs in runs.items():
            wall = [r.us_per_token for r in rs]
            host = [r.host_us_per_token for r in rs]
            print(f"{text:6} {mode:6} {statistics.median(wall):8.1f} µs/token ({min(wall):.1f}-{max(wall):.1f}), "
                  f"host {statistics.median(host):6.1f} µs/token ({min(host):.1f}-{max(host):.1f}), "
                  f"{statistics.median(r.tokens_per_call for r in rs):.2f} tokens/call, "
                  f"{plain / statistics.median(wall):.3f}x plain")
        assert all(r.tokens == runs["plain"][0].tokens for rs in runs.values() for r in rs), "a reply changed"


if __name__ == "__main__":
    main()
