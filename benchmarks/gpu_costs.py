"""What one placement of a GGUF model costs per call: t1 (a one-token decode), c(k) = t(k)/t1
for k-token verify calls, and prompt processing, through Tandem's llama.cpp backend (its
exact configuration) and, with ``--peer``, llama-cpp-python's ``Llama`` at its defaults on
the same file and placement. Combined with acceptance measured on the real models, these
give modeled speeds for a placement (``benchmarks/policy_replay.py``'s pricing).

Each line of output is one JSON object; with several ``--ngl`` values the model is reloaded
per value, and every measurement alternates calls so load drift hits all alike.

    python -m benchmarks.gpu_costs MODEL.gguf --ngl -1,12 --threads 16 [--kv q8_0] [--peer]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PROMPT = 480


def ids_for(n_vocab: int, n: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + salt * 104729) % (n_vocab - 200) + 100 for i in range(n)]


def measure_ours(model: str, ngl: int, threads: int, kv: str, ks: list[int], reps: int) -> dict:
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    start = time.perf_counter()
    b = LlamaCppBackend(model, LlamaConfig(n_ctx=2048, n_batch=512, n_gpu_layers=ngl, n_threads=threads,
                                           type_k=kv, type_v=kv))
    load = time.perf_counter() - start
    try:
        prompt = ids_for(b.n_vocab, PROMPT)
        prefill = []
        for r in range(3):
            b.truncate(0)
            t = time.perf_counter()
            b.evaluate(ids_for(b.n_vocab, PROMPT, r))
            prefill.append(time.perf_counter() - t)
        b.truncate(0)
        b.evaluate(prompt)
        base = len(b.tokens)
        times: dict[int, list[float]] = {k: [] for k in ks}
        for r in range(reps):
            for k in ks:  # alternating: every k sees the same drift
                toks = ids_for(b.n_vocab, k, 1000 + r)
                t = time.perf_counter()
                b.evaluate(toks, logits_for=range(k))
                times[k].append(time.perf_counter() - t)
                b.truncate(base)
        med = {k: statistics.median(v[1:] if len(v) > 2 else v) for k, v in times.items()}
        t1 = med[ks[0]]
        return {"who": "tandem", "ngl": ngl, "threads": threads, "kv": kv, "load_s": round(load, 2),
                "prefill_tok_s": round(PROMPT / statistics.median(prefill), 1), "t1_ms": round(t1 * 1e3, 3),
                "decode_tok_s": round(1 / t1, 1),
                "c": {k: round(v / t1, 3) for k, v in med.items()},
                "spread_t1_ms": [round(min(times[ks[0]]) * 1e3, 3), round(max(times[ks[0]]) * 1e3, 3)]}
    finally:
        b.close()


def measure_peer(model: str, ngl: int, threads: int, reps: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model, n_gpu_layers=ngl, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    try:
        nv = llm.n_vocab()
        prefill, steps = [], []
        for r in range(3):
            llm.reset()
            t = time.perf_counter()
            llm.eval(ids_for(nv, PROMPT, r))
            prefill.append(time.perf_counter() - t)
        base = llm.n_tokens
        for r in range(reps * 4):
            llm.n_tokens = base
            t = time.perf_counter()
            llm.eval([ids_for(nv, 1, 2000 + r)[0]])
            steps.append(time.perf_counter() - t)
        t1 = statistics.median(steps[2:])
        return {"who": "llama-cpp-python", "ngl": ngl, "threads": threads, "kv": "f16",
                "prefill_tok_s": round(PROMPT / statistics.median(prefill), 1), "t1_ms": round(t1 * 1e3, 3),
                "decode_tok_s": round(1 / t1, 1)}
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ngl", default="-1", help="comma-separated n_gpu_layers values")
    ap.add_argument("--threads", type=int, default=0, help="default: every core")
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--ks", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--peer", action="store_true", help="also time llama-cpp-python's Llama at the same placement")
    args = ap.parse_args(argv)
    import os

    threads = args.threads or os.cpu_count() or 1
    ks = [int(k) for k in args.ks.split(",")]
    for ngl in (int(v) for v in args.ngl.split(",")):
        row = measure_ours(args.model, ngl, threads, args.kv, ks, args.reps)
        row["model"] = os.path.basename(args.model)
        print(json.dumps(row), flush=True)
        if args.peer:
            peer = measure_peer(args.model, ngl, threads, args.reps)
            peer["model"] = row["model"]
            peer["ratio_decode"] = round(row["decode_tok_s"] / peer["decode_tok_s"], 3)
            peer["ratio_prefill"] = round(row["prefill_tok_s"] / peer["prefill_tok_s"], 3)
            print(json.dumps(peer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
