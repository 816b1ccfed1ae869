"""MoE experts in host memory, llama.cpp on a GPU: decode speed of three placements and
whether greedy output stays the all-CPU model's.

* ``cpu``: every layer on CPU threads (``n_gpu_layers=0``), the reference;
* ``exps=CPU``: every layer on the GPU with *all* experts in host memory (llama.cpp's
  ``-ot exps=CPU``; :mod:`tandem.runtime.backends.host_experts` with ``-1``);
* ``planned``: what ``tandem plan --moe-offload --vram BUDGET`` chooses: the experts of the
  fewest layers in host memory for the rest to fit the budget.

All three are loaded at once (the experts' host copy is the same mapped file) and timed
in alternating rounds: each round decodes ``--tokens`` greedy tokens after the same
prompt, per placement in turn; tok/s is the median over rounds, with the spread. Then the
planned placement's greedy tokens are compared with the CPU's: equal, or the first
position that differs and the CPU's top-2 logit gap there (a near-tie flips under a
different summation order, which CUDA's kernels have).

llama.cpp's log goes to ``DIR/llama.log`` (each load's "buffer type overridden" lines
and buffer sizes are counted into the JSON, so the placement is shown, not assumed); the
results are written to ``DIR/gpu_moe.json`` after every stage, so a crash keeps what was
measured. On a CPU build every placement runs on the CPU (a quick check of this script).

    python -m benchmarks.gpu_moe MODEL.gguf --vram 8GiB --out DIR [--tokens 24] [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

PROMPT = "The capital of France is Paris. The capital of Germany is"
CHECK_TOKENS = 16
BUFFER = re.compile(r"(\S+) model buffer size = +([\d.]+) MiB")


class LlamaLog:
    """llama.cpp's log into a file, with the lines of the load in progress kept apart."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.file = path.open("w", encoding="utf-8")
        self.lines: list[str] = []

        @llama_cpp.llama_log_callback
        def hear(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            line = text.decode("utf-8", "replace")
            self.file.write(line)
            self.lines.append(line)

        self._callback = hear  # referenced for as long as llama.cpp may call it
        llama_cpp.llama_log_set(hear, ctypes.c_void_p(0))

    def close(self) -> None:
        """Give llama.cpp's log back to the backend's own callback and close the file."""

        from tandem.runtime.backends import llama_log

        llama_log.install()
        self.file.close()

    def take(self) -> str:
        """Everything logged since the last call."""
        text, self.lines = "".join(self.lines), []
        self.file.flush()
        return text


def placement_seen(log: str) -> dict:
    """What llama.cpp says it did in one load: tensors overridden to a host buffer type,
    and MiB of weights per buffer type."""
    overridden = [line.split()[1] for line in log.splitlines()
                  if line.startswith("tensor ") and "buffer type overridden to" in line]
    buffers: dict[str, float] = {}
    for name, mib in BUFFER.findall(log):
        buffers[name] = buffers.get(name, 0.0) + float(mib)
    return {"overridden_tensors": len(overridden), "model_buffers_mib": buffers}


def planned_layers(model: Path, vram: str, ctx: int) -> tuple[int, int, dict]:
    """(n_gpu_layers, host_expert_layers, plan summary) ``tandem plan --moe-offload`` picks."""
    from tandem.runtime.planning.hardware import resolve_machine
    from tandem.runtime.planning.plan import PlanRequest
    from tandem.runtime.planning.planner import make_plan

    machine = resolve_machine(None, None, vram, measure_bandwidth=False)
    plan = make_plan(PlanRequest(model, None, ctx, machine, draft_max=1, model_free=False, moe_offload=True))
    t = plan.target
    return t.n_gpu_layers, t.host_expert_layers, {
        "fits": plan.fits, "vram_budget": plan.vram_budget, "predicted_gpu_bytes": plan.memory.gpu,
        "predicted_host_bytes": plan.memory.host, "reasons": plan.reasons}


def say(text: str) -> None:
    """Progress, on stderr (stdout is the table)."""
    print(f"gpu_moe: {text}", file=sys.stderr, flush=True)


def decode_round(backend, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Seconds for ``n`` one-token greedy steps after ``prompt`` (the prompt is kept in the
    cache between rounds, so only decoding is timed), and the tokens."""
    backend.truncate(len(prompt) - 1)
    logits = backend.evaluate(prompt[-1:])
    out = []
    start = time.perf_counter()
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = backend.evaluate([out[-1]])
    return time.perf_counter() - start, out


def greedy_with_logits(backend, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    backend.truncate(0)
    logits = backend.evaluate(prompt)[-1]
    out, rows = [], []
    for _ in range(n):
        rows.append(np.asarray(logits, dtype=np.float64))
        out.append(int(np.argmax(logits)))
        logits = backend.evaluate([out[-1]])[-1]
    return out, rows


def compare(reference: tuple[list[int], list[np.ndarray]], candidate: list[int]) -> dict:
    """Equal, or the first differing position and the reference's top-2 gap there."""
    tokens, rows = reference
    for i, (a, b) in enumerate(zip(tokens, candidate, strict=True)):
        if a != b:
            top = np.sort(rows[i])[-2:]
            return {"equal": False, "first_difference": i, "cpu_token": a, "planned_token": b,
                    "cpu_top2_gap": float(top[1] - top[0])}
    return {"equal": True, "tokens": len(tokens)}


def run(model: Path, vram: str, out_dir: Path, tokens: int, rounds: int, ctx: int, home: int | None = None,
        time_budget_s: float = 40.0) -> dict:
    """``time_budget_s``: no timed round starts after this many seconds of the run (at least
    one always runs), so a slow host cannot push the run past its time limit."""
    from tandem.runtime.backends.host_experts import ALL_LAYERS
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.backends.llama_devices import gpu_devices, gpu_offload_build

    began = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    result_path = out_dir / "gpu_moe.json"
    result: dict = {"model": str(model), "vram": vram, "tokens_per_round": tokens, "rounds": rounds,
                    "gpu_build": gpu_offload_build(), "gpus": [asdict(d) for d in gpu_devices()]}

    def save() -> None:
        result_path.write_text(json.dumps(result, indent=2))

    say("planning --moe-offload --vram " + vram)
    g, n_home, plan = planned_layers(model, vram, ctx)
    result["plan"] = {"n_gpu_layers": g, "host_expert_layers": n_home, **plan}
    if home is not None:  # checking this script on a CPU build, where the plan offloads nothing
        g, n_home = -1, home
        result["plan"]["overridden_by_home"] = home
    save()
    log = LlamaLog(out_dir / "llama.log")
    configs = {"cpu": LlamaConfig(n_ctx=ctx, n_gpu_layers=0),
               "exps=CPU": LlamaConfig(n_ctx=ctx, n_gpu_layers=-1, host_expert_layers=ALL_LAYERS),
               "planned": LlamaConfig(n_ctx=ctx, n_gpu_layers=g, host_expert_layers=n_home)}
    backends = {}
    try:
        result["loads"] = {}
        for name, cfg in configs.items():
            say(f"loading {name} (n_gpu_layers {cfg.n_gpu_layers}, experts home {cfg.host_expert_layers})")
            start = time.perf_counter()
            log.take()
            backends[name] = LlamaCppBackend(model, cfg)
            result["loads"][name] = {"n_gpu_layers": cfg.n_gpu_layers, "host_expert_layers": cfg.host_expert_layers,
                                     "load_s": round(time.perf_counter() - start, 2), **placement_seen(log.take())}
            save()
        prompt = backends["cpu"].tokenizer.tokenize(PROMPT, add_bos=True)
        for b in backends.values():
            b.evaluate(prompt)
            decode_round(b, prompt, 2)  # warm-up: first-call allocations, kernel selection
        times: dict[str, list[float]] = {name: [] for name in backends}
        for r in range(rounds):
            if r and time.perf_counter() - began > time_budget_s:
                result["rounds_run"] = r  # stopped early: the time budget was spent
                break
            say(f"timed round {r + 1}/{rounds}")
            for name, b in backends.items():
                seconds, _ = decode_round(b, prompt, tokens)
                times[name].append(tokens / seconds)
        result["decode_tok_s"] = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}
                                  for name, v in times.items()}
        save()
        say(f"greedy check, {CHECK_TOKENS} tokens")
        reference = greedy_with_logits(backends["cpu"], prompt, CHECK_TOKENS)
        planned, _ = greedy_with_logits(backends["planned"], prompt, CHECK_TOKENS)
        result["greedy_planned_vs_cpu"] = compare(reference, planned)
        save()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"  # the JSON says where it stopped
        save()
        raise
    finally:
        for b in backends.values():
            b.close()
        log.close()
    return result


def table(result: dict) -> str:
    rows = [f"{'placement':10} {'gpu layers':>10} {'experts home':>12} {'tok/s (median)':>15} {'range':>17} "
            f"{'x cpu':>6}"]
    speeds = result.get("decode_tok_s", {})
    base = speeds.get("cpu", {}).get("median")
    for name, load in result.get("loads", {}).items():
        s = speeds.get(name)
        home = "all" if load["host_expert_layers"] == -1 else str(load["host_expert_layers"])
        rows.append(f"{name:10} {load['n_gpu_layers']:>10} {home:>12} "
                    + (f"{s['median']:>15.2f} {s['min']:>8.2f}-{s['max']:<8.2f} {s['median'] / base:>6.2f}"
                       if s and base else f"{'-':>15}"))
    plan = result.get("plan", {})
    planned = result.get("loads", {}).get("planned", {}).get("model_buffers_mib", {})
    gpu_mib = sum(v for k, v in planned.items() if not k.startswith("CPU") and not k.endswith("_Host"))
    rows.append(f"planned: predicted {plan.get('predicted_gpu_bytes', 0) / 2**20:.0f} MiB GPU of a "
                f"{plan.get('vram_budget', 0) / 2**20:.0f} MiB budget; llama.cpp's GPU model buffers "
                f"{gpu_mib:.0f} MiB")
    check = result.get("greedy_planned_vs_cpu")
    if check:
        rows.append("greedy planned vs cpu: " + ("equal" if check["equal"] else
                    f"first difference at token {check['first_difference']} (cpu top-2 gap "
                    f"{check['cpu_top2_gap']:.4f})"))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--vram", required=True, help="GPU budget for the planned placement: bytes or e.g. 8GiB")
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_moe.json and llama.log")
    p.add_argument("--tokens", type=int, default=24, help="decoded tokens per timed round (default 24)")
    p.add_argument("--rounds", type=int, default=5, help="alternating timed rounds (default 5)")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--time-budget", type=float, default=40.0, metavar="S",
                   help="start no timed round after S seconds (default 40; at least one round runs)")
    p.add_argument("--home", type=int, default=None, metavar="N",
                   help="use all GPU layers with the experts of N layers at home instead of the plan's choice "
                        "(to check this script on a CPU build, where the plan offloads nothing)")
    args = p.parse_args(argv)
    from tandem.errors import TandemError

    try:
        result = run(args.model, args.vram, args.out, args.tokens, args.rounds, args.ctx, args.home,
                     args.time_budget)
    except TandemError as exc:
        print(f"gpu_moe: error: {exc}", file=sys.stderr)
        return 2
    print(table(result))
    print(f"results: {args.out / 'gpu_moe.json'}; llama.cpp log: {args.out / 'llama.log'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
