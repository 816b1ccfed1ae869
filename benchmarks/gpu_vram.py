"""Predicted against allocated GPU memory, llama.cpp on a CUDA GPU, for the planner's cases.

For each case the planner plans on this machine (as `tandem run` does), then a fresh
child process realises the plan and measures with the free-memory query around each
step: before CUDA is touched (``nvidia-smi``, so the CUDA context itself is seen), after
the context is made, after the models and contexts load, and after a full prefill batch,
a 9-row verify and decode steps (the CUDA pool's scratch grows while computing). The
child also logs llama.cpp's own buffer sizes per buffer type ("CUDA0 model buffer size",
"KV buffer size", "compute buffer size"), so a miss can be traced to one formula.

Cases: every layer on the GPU with an f16, q8_0 and q4_0 KV cache; part of the layers
under a small ``--vram`` (half of what full offload needs); a drafter on the GPU next to
its target. Goal: predicted within ±10 % of allocated, and allocated never above ``--vram``.

    python -m benchmarks.gpu_vram --target T.gguf --draft D.gguf [--ctx 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

MiB = 1024**2


def nvidia_smi_used(index: int = 0) -> int:
    """Bytes in use on GPU ``index`` as the driver reports them (MiB resolution)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(index)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[0]) * MiB


# -- the child: realise one plan and measure --------------------------------------------
def child(spec: dict) -> dict:
    used0 = nvidia_smi_used()
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.backends.llama_devices import gpu_devices

    def free() -> int:
        return gpu_devices()[0].free_bytes

    free1 = free()  # the CUDA context exists from here on
    used1 = nvidia_smi_used()
    backends = [LlamaCppBackend(m["path"], LlamaConfig(**m["config"])) for m in spec["models"]]
    free2 = free()
    for b in backends:
        ids = [(i * 7919) % 30000 + 100 for i in range(min(b.n_ctx - 32, 600))]
        b.evaluate(ids)
        b.evaluate(ids[:9], logits_for=range(9))
        for t in ids[:8]:
            b.evaluate([t])
    free3 = free()
    used3 = nvidia_smi_used()
    for b in backends:
        b.close()
    return {"used_before_cuda": used0, "used_with_context": used1, "used_after_decode": used3,
            "free_with_context": free1, "free_after_load": free2, "free_after_decode": free3}


LOGGED = re.compile(r"(\S+)\s+(model buffer|KV buffer|compute buffer|output buffer) size\s*=\s*([0-9.]+) MiB")


def logged_buffers(stderr: str) -> dict[str, int]:
    """llama.cpp's logged buffer sizes, summed per "<buffer type> <what>"."""
    sizes: dict[str, int] = {}
    for m in LOGGED.finditer(stderr):
        key = f"{m.group(1).rstrip(':')} {m.group(2)}"
        sizes[key] = sizes.get(key, 0) + int(float(m.group(3)) * MiB)
    return sizes


# -- the parent: plan each case, run its child, compare ---------------------------------
def plan_case(target: Path, draft: Path | None, ctx: int, vram: int | None, kv: str | None):
    from tandem.runtime.planning.hardware import resolve_machine
    from tandem.runtime.planning.plan import PlanRequest
    from tandem.runtime.planning.planner import make_plan

    machine = resolve_machine(None, None, vram, measure_bandwidth=False)
    return make_plan(PlanRequest(target, draft, ctx, machine, kv_type=kv, model_free=False,
                                 drop_slow_draft=False))


def run_case(name: str, plan, timeout: float) -> dict:
    models = [{"path": plan.target.path, "config": asdict(plan.target.llama_config())}]
    if plan.draft is not None:
        models.append({"path": plan.draft.path, "config": asdict(plan.draft.llama_config())})
    for m in models:
        m["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in m["config"].items()}
    env = {**os.environ, "TANDEM_LLAMA_LOG": "1"}
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "benchmarks.gpu_vram", "--child",
                           json.dumps({"models": models})], capture_output=True, text=True, env=env, timeout=timeout)
    row: dict = {"case": name, "fits": plan.fits, "vram_budget": plan.vram_budget,
                 "target_n_gpu_layers": plan.target.n_gpu_layers,
                 "draft_n_gpu_layers": plan.draft.n_gpu_layers if plan.draft else None,
                 "kv": plan.target.type_k,
                 "predicted_items": [asdict(i) for i in plan.memory.items if i.device == "gpu"],
                 "predicted_gpu": plan.memory.gpu,
                 "predicted_context": sum(i.bytes for i in plan.memory.items
                                          if i.device == "gpu" and "context" in i.label)}
    if done.returncode != 0:
        from tandem.errors import child_failure

        row["error"] = child_failure("measuring child", done.returncode, done.stderr)
        row["stderr_tail"] = done.stderr[-3000:]
        return row
    m = json.loads(done.stdout.strip().splitlines()[-1])
    row |= m
    row["logged"] = logged_buffers(done.stderr)
    row["allocated_context"] = m["used_with_context"] - m["used_before_cuda"]
    row["allocated_models"] = m["free_with_context"] - m["free_after_decode"]
    row["allocated_gpu"] = row["allocated_context"] + row["allocated_models"]
    row["error_pct"] = round(100 * (row["predicted_gpu"] / max(row["allocated_gpu"], 1) - 1), 1)
    row["within_budget"] = row["allocated_gpu"] <= plan.vram_budget
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    target, draft = Path(args.target), Path(args.draft) if args.draft else None
    full = plan_case(target, None, args.ctx, None, "f16")
    cases = [("every layer, KV f16", full),
             ("every layer, KV q8_0", plan_case(target, None, args.ctx, None, "q8_0")),
             ("every layer, KV q4_0", plan_case(target, None, args.ctx, None, "q4_0")),
             ("part of the layers, --vram half of full", plan_case(target, None, args.ctx, full.memory.gpu // 2, "f16"))]
    if draft is not None:
        cases.append(("target and drafter on the GPU", plan_case(target, draft, args.ctx, None, "f16")))
    rows = []
    print(f"{'case':42} {'ngl':>5} {'predicted':>12} {'allocated':>12} {'error':>7} {'context p/a':>17}  budget")
    for name, plan in cases:
        row = run_case(name, plan, args.timeout)
        rows.append(row)
        if "error" in row:
            print(f"{name:42} FAILED: {row['error']}")
            continue
        print(f"{name:42} {row['target_n_gpu_layers']:>5} {row['predicted_gpu'] / MiB:>10.1f}Mi "
              f"{row['allocated_gpu'] / MiB:>10.1f}Mi {row['error_pct']:>6.1f}% "
              f"{row['predicted_context'] / MiB:>7.0f}/{row['allocated_context'] / MiB:<7.0f}Mi  "
              f"{'within' if row['within_budget'] else 'OVER'} {row['vram_budget'] / MiB:.0f} MiB")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_vram.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
