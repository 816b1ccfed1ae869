"""`/infill` latency and fill quality on a corpus of llama.vim-shaped requests.

    python -m benchmarks.infill -m MODEL.gguf --threads 2 [--baseline] [--json out.json]

For each server mode (Tandem's default, speculative decoding on; and ``--no-spec``,
plain greedy) it starts ``tandem serve`` as a subprocess, sends one request (cold: the
first after loading), one llama.vim warm-up (``n_predict: 0``), then the corpus: the 30
holes of :mod:`.bench_infill_corpus`, each once without and once with three other
snippets as ``input_extra`` (60 requests), streamed, as llama.vim shapes them
(``n_indent``, ``t_max_predict_ms``, greedy). It reports time to first token and to the
full suggestion (p50, p95), tokens, prompt-cache reuse and exact-match fill quality.

``--baseline``: llama-cpp-python's ``Llama.create_completion`` in this process on the
same model, threads and *token-identical prompts* (rendered by :mod:`.fim`), streaming
as many tokens as Tandem's default returned for that request (its own prompt-prefix
reuse on). It has no HTTP hop, which favours it slightly.

The machine may be shared: the 1-minute load average before and after is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.infill_corpus import Hole, fill_matches, holes

N_PREDICT = 48
T_MAX_PREDICT_MS = 1000
N_CTX = 2048


def requests_for(corpus: list[Hole]) -> list[dict]:
    """Each hole twice: alone, and with three other snippets as extra context."""
    out = []
    for with_extra in (False, True):
        for i, h in enumerate(corpus):
            extra = []
            if with_extra:
                for j in (1, 2, 3):
                    other = corpus[(i + j * 7) % len(corpus)]
                    text = other.prefix + other.prompt + other.answer + other.suffix
                    extra.append({"text": text, "time": 0, "filename": f"snippet_{(i + j * 7) % len(corpus)}.py"})
            out.append({"id_slot": 0, "input_prefix": h.prefix, "input_suffix": h.suffix, "input_extra": extra,
                        "prompt": h.prompt, "n_predict": N_PREDICT, "stop": [], "n_indent": h.indent,
                        "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
                        "t_max_prompt_ms": 500, "t_max_predict_ms": T_MAX_PREDICT_MS, "stream": True,
                        "_hole": i})
    return out


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@dataclass
class Run:
    ttft_ms: list[float] = field(default_factory=list)
    total_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    prompt_n: list[int] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)
    multi: list[bool] = field(default_factory=list)
    contents: list[str] = field(default_factory=list)
    cold_ms: float = 0.0

    def summary(self) -> dict:
        single = [e for e, m in zip(self.exact, self.multi, strict=True) if not m]
        multi = [e for e, m in zip(self.exact, self.multi, strict=True) if m]
        out = {"requests": len(self.total_ms),
               "ttft_p50_ms": percentile(self.ttft_ms, 0.5), "ttft_p95_ms": percentile(self.ttft_ms, 0.95),
               "full_p50_ms": percentile(self.total_ms, 0.5), "full_p95_ms": percentile(self.total_ms, 0.95),
               "tokens_p50": statistics.median(self.tokens) if self.tokens else 0}
        if self.exact:
            out |= {"exact_single": f"{sum(single)}/{len(single)}", "exact_multi": f"{sum(multi)}/{len(multi)}",
                    "exact_all": sum(self.exact) / len(self.exact)}
        if self.cached:
            out |= {"tokens_cached_p50": statistics.median(self.cached), "prompt_n_p50": statistics.median(self.prompt_n)}
        if self.cold_ms:
            out["cold_first_ms"] = self.cold_ms
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(client, url: str, body: dict) -> tuple[float, float, dict, str]:
    """(ms to the first content, ms to the final event, final event, content) of one streamed /infill."""
    t0 = time.perf_counter()
    first = None
    final: dict = {}
    parts = []
    with client.stream("POST", f"{url}/infill", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            if first is None and ev.get("content"):
                first = time.perf_counter()
            parts.append(ev.get("content", ""))
            if ev.get("stop"):
                final = ev
    end = time.perf_counter()
    return ((first or end) - t0) * 1000, (end - t0) * 1000, final, "".join(parts)


def _superposed(client, url: str, reqs: list[dict], corpus: list[Hole], k: int, log) -> Run:
    """The same requests with ``n = k`` at temperature 0: k superposed drafts, judged
    exact when any of them matches (the editor shows them to pick from)."""
    run = Run()
    for req in reqs:
        body = {key: v for key, v in req.items() if key != "_hole"} | {"n": k, "stream": False, "temperature": 0}
        t0 = time.perf_counter()
        r = client.post(f"{url}/infill", json=body, timeout=300)
        r.raise_for_status()
        run.total_ms.append((time.perf_counter() - t0) * 1000)
        drafts = r.json().get("drafts", [])
        run.ttft_ms.append(run.total_ms[-1])
        run.tokens.append(int(r.json().get("tokens_predicted", 0)))
        run.exact.append(any(fill_matches(corpus[req["_hole"]], d) for d in drafts))
        run.multi.append(corpus[req["_hole"]].multi_line)
    log(f"  superposed k={k}: {len(reqs)} requests")
    return run


def typing_requests(corpus: list[Hole], n_holes: int = 10, step: int = 4) -> list[dict]:
    """An editor session: for each hole, a request every ``step`` typed characters of its
    first line (the cursor line grows, the rest of the file stays), llama.vim-shaped."""
    base = requests_for(corpus)
    out = []
    for req in base[:n_holes]:
        first_line = corpus[req["_hole"]].answer.split("\n")[0]
        for j in range(0, len(first_line), step):
            out.append(req | {"prompt": req["prompt"] + first_line[:j], "input_suffix": req["input_suffix"]})
    return out


LONG_TOKENS = 32


def long_requests(reqs: list[dict], n_holes: int = 10) -> list[dict]:
    """A 32-token suggestion on a cached prompt, not streamed (llama.vim and llama.vscode
    send ``stream: false``): llama.vim's warm-up (``n_predict: 0``) has filled the cache,
    then the same request asks for 32 tokens with no indent or time stop."""
    return [req | {"n_predict": LONG_TOKENS, "n_indent": 0, "t_max_predict_ms": 0} for req in reqs[:n_holes]]


def run_server_mode(model: str, threads: int, extra_args: list[str], reqs: list[dict], corpus: list[Hole],
                    log, superposed_k: int = 0, typing_session: bool = False,
                    long_session: bool = False) -> tuple[Run, list[dict], Run | None, Run, Run]:
    import httpx

    port = _free_port()
    cmd = [str(Path(sys.executable).with_name("tandem")), "serve", "-m", model, "--threads", str(threads), "--port", str(port),
           "--ctx", str(N_CTX), *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    run, finals = Run(), []
    try:
        with httpx.Client() as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if client.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tandem serve did not start: {proc.stderr.read() if proc.stderr else ''}")
                time.sleep(0.2)
            body = {k: v for k, v in reqs[0].items() if k != "_hole"}
            run.cold_ms = _stream(client, url, body)[1]
            log(f"  cold first request: {run.cold_ms:.0f} ms")
            warm = body | {"n_predict": 0, "input_prefix": "", "input_suffix": "", "prompt": "", "stream": False}
            client.post(f"{url}/infill", json=warm, timeout=300)
            for req in reqs:
                ttft, total, final, content = _stream(client, url, {k: v for k, v in req.items() if k != "_hole"})
                finals.append(final)
                run.ttft_ms.append(ttft)
                run.total_ms.append(total)
                run.tokens.append(int(final.get("timings", {}).get("predicted_n", 0)))
                run.cached.append(int(final.get("tokens_cached", 0)))
                run.prompt_n.append(int(final.get("timings", {}).get("prompt_n", 0)))
                run.contents.append(content)
            sup = _superposed(client, url, reqs, corpus, superposed_k, log) if superposed_k else None
            typing = Run()
            for req in typing_requests(corpus) if typing_session else []:
                ttft, total, final, _ = _stream(client, url, {k: v for k, v in req.items() if k != "_hole"})
                typing.ttft_ms.append(ttft)
                typing.total_ms.append(total)
                typing.tokens.append(int(final.get("timings", {}).get("predicted_n", 0)))
                typing.cached.append(int(final.get("tokens_cached", 0)))
                typing.prompt_n.append(int(final.get("timings", {}).get("prompt_n", 0)))
            long = Run()
            for req in long_requests(reqs) if long_session else []:
                body = {k: v for k, v in req.items() if k != "_hole"} | {"stream": False}  # as llama.vim sends it
                client.post(f"{url}/infill", json=body | {"n_predict": 0}, timeout=300)
                t0 = time.perf_counter()
                r = client.post(f"{url}/infill", json=body, timeout=300)
                r.raise_for_status()
                total = ttft = (time.perf_counter() - t0) * 1000  # not streamed: the whole suggestion at once
                final = r.json()
                if int(final.get("timings", {}).get("predicted_n", 0)) < LONG_TOKENS:
                    continue  # ended early (end of the fill): not a 32-token suggestion
                long.ttft_ms.append(ttft)
                long.total_ms.append(total)
                long.tokens.append(LONG_TOKENS)
                long.cached.append(int(final.get("tokens_cached", 0)))
                long.prompt_n.append(int(final.get("timings", {}).get("prompt_n", 0)))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return run, finals, sup, typing, long


def run_baseline(model: str, threads: int, reqs: list[dict], token_counts: list[int], log) -> Run:
    """llama-cpp-python on token-identical prompts, as many tokens as Tandem returned."""
    import llama_cpp

    from tandem.runtime.autocomplete.fim import ExtraChunk, FimBudget, InfillText, infill_prompt
    from tandem.runtime.backends.llama_vocab import LlamaVocab

    llm = llama_cpp.Llama(model_path=model, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, n_batch=512,
                          verbose=False)
    vocab = LlamaVocab.open(model)
    run = Run()
    try:
        for req, n in zip(reqs, token_counts, strict=True):
            text = InfillText(req["input_prefix"], req["input_suffix"], req["prompt"],
                              tuple(ExtraChunk(c["filename"], c["text"]) for c in req["input_extra"]))
            ids = infill_prompt(vocab, text, FimBudget(n_ctx=N_CTX, n_predict=N_PREDICT)).tokens  # type: ignore[arg-type]
            t0 = time.perf_counter()
            first = None
            got = 0
            for _ in llm.create_completion(ids, max_tokens=max(1, n), temperature=0.0, stream=True):
                got += 1
                if first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
            run.ttft_ms.append(((first or end) - t0) * 1000)
            run.total_ms.append((end - t0) * 1000)
            run.tokens.append(got)
    finally:
        vocab.close()
        llm.close()
    log(f"  baseline: {len(run.total_ms)} requests")
    return run


def markdown(results: dict) -> str:
    lines = ["| mode | requests | TTFT p50 ms | TTFT p95 ms | full p50 ms | full p95 ms | tokens p50 | "
             "exact single | exact multi | cached p50 | cold first ms |", "|---" * 11 + "|"]
    for name, s in results["modes"].items():
        lines.append(f"| {name} | {s['requests']} | {s['ttft_p50_ms']:.0f} | {s['ttft_p95_ms']:.0f} | "
                     f"{s['full_p50_ms']:.0f} | {s['full_p95_ms']:.0f} | {s['tokens_p50']:.0f} | "
                     f"{s.get('exact_single', '-')} | {s.get('exact_multi', '-')} | "
                     f"{s.get('tokens_cached_p50', '-')} | {s.get('cold_first_ms', 0):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.infill", description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--draft", help="drafter model for Tandem's default mode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline", action="store_true", help="also llama-cpp-python on the same prompts")
    ap.add_argument("--no-plain", action="store_true", help="skip the --no-spec (plain greedy) server")
    ap.add_argument("--superposed", type=int, default=0, metavar="K",
                    help="also the requests with n=K at temperature 0 (superposed drafts) on the default server")
    ap.add_argument("--typing", action="store_true",
                    help="also an editor session on the default server: a request every 4 typed characters")
    ap.add_argument("--long", action="store_true",
                    help="also 32-token suggestions on a cached prompt (warm-up first) on the default server")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    corpus = holes()
    reqs = requests_for(corpus)
    results: dict = {"model": Path(args.model).name, "threads": args.threads, "n_predict": N_PREDICT,
                     "t_max_predict_ms": T_MAX_PREDICT_MS, "load_before": os.getloadavg()[0], "modes": {}}
    modes = [("tandem (default)", ["--draft", args.draft] if args.draft else [])]
    if not args.no_plain:
        modes.append(("plain greedy (--no-spec)", ["--no-spec"]))
    token_counts: list[int] = []
    for name, extra in modes:
        log(f"{name} ...")
        first_mode = not token_counts
        run, finals, sup, typing, long = run_server_mode(args.model, args.threads, extra, reqs, corpus, log,
                                                         superposed_k=args.superposed if first_mode else 0,
                                                         typing_session=args.typing and first_mode,
                                                         long_session=args.long and first_mode)
        if typing.total_ms:
            results["modes"]["typing session (prompt grows, cache reused)"] = typing.summary()
        if long.total_ms:
            results["modes"][f"{LONG_TOKENS}-token suggestion, prompt cached"] = long.summary()
        run.exact = [fill_matches(corpus[r["_hole"]], c) for r, c in zip(reqs, run.contents, strict=True)]
        run.multi = [corpus[r["_hole"]].multi_line for r in reqs]
        results["modes"][name] = run.summary()
        log(json.dumps({name: results["modes"][name]}))
        if sup is not None:
            results["modes"][f"superposed k={args.superposed} (any of k; full time)"] = sup.summary()
        if not token_counts:
            token_counts = run.tokens
    if args.baseline:
        log("llama-cpp-python ...")
        results["modes"]["llama-cpp-python (same prompts)"] = run_baseline(args.model, args.threads, reqs,
                                                                           token_counts, log).summary()
    results["load_after"] = os.getloadavg()[0]
    print(markdown(results))
    print(f"\nload average (1 min): {results['load_before']:.2f} before, {results['load_after']:.2f} after")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
