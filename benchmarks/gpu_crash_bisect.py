"""Which setting makes a CUDA build of llama.cpp crash under Tandem: one child per variant.

On a CUDA build, `tandem run` and the process baseline child died of SIGSEGV while
llama-cpp-python's own ``Llama`` decoded the same file. The variants below differ from
each other by one thing each (the peer's defaults, our exact configuration, GPU layers,
the Python log callback, flash attention, threads, torch's CUDA context in the same
process, the tiny F32 model the baseline child runs, the baseline child itself, the CLI),
so the first column that says "died" names the cause. Each child runs with Python's
faulthandler on: a crash prints the Python frame it happened under, shown here.

    python -m benchmarks.gpu_crash_bisect MODEL.gguf [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tandem.errors import child_failure

DECODE = """
ids = [(i * 7919) % 30000 + 100 for i in range(300)]
def run(evaluate):
    evaluate(ids[:291]); evaluate(ids[291:300], rows=9)
    for t in range(16): evaluate([ids[t]])
"""

PEER = """
import sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_gpu_layers={ngl}, n_ctx=1024, n_batch=512, verbose=False, logits_all=True)
""" + DECODE + """
run(lambda toks, rows=1: llm.eval(toks))
llm.close()
"""

OURS = """
import sys
{before}
from tandem.runtime.backends.llama import LlamaConfig, LlamaCppBackend
{after}
b = LlamaCppBackend(sys.argv[1], LlamaConfig(n_ctx=1024, n_batch=256, n_gpu_layers={ngl}, flash_attn={fa},
                                             n_threads={threads}))
""" + DECODE + """
run(lambda toks, rows=1: b.evaluate(toks, logits_for=range(len(toks) - rows, len(toks))))
b.close()
"""

TINY = """
{before}
import sys, tempfile
from pathlib import Path
from tandem.runtime.backends.llama import LlamaConfig, LlamaCppBackend
from tandem.runtime.backends.selfcheck import write_tiny_llama
with tempfile.TemporaryDirectory() as d:
    path = write_tiny_llama(Path(d) / "tiny.gguf")
    b = LlamaCppBackend(path, LlamaConfig(n_ctx=256, n_batch=256))
    b.evaluate([3 + i % 250 for i in range(240)])
    b.evaluate([5] * 9, logits_for=list(range(9)))
    for _ in range(4):
        b.evaluate([7])
    b.close()
"""

DEFAULT_LOG = "import ctypes, llama_cpp\nllama_cpp.llama_log_set(llama_cpp.llama_log_callback(), ctypes.c_void_p(0))  # NULL: llama.cpp's own"
TORCH_FIRST = "import torch\ntorch.cuda.mem_get_info()"


def patched(function: str, line: str) -> str:
    """Code that wraps the backend's ``model_params``/``context_params`` to change one field
    (``line`` sets it on ``p``) toward llama-cpp-python's defaults."""
    return (f"import tandem.runtime.backends.llama as L\n_orig = L.{function}\n"
            f"def _patched(*a):\n    p = _orig(*a)\n    {line}\n    return p\nL.{function} = _patched")


REDIRECTED = ("import tandem.runtime.backends.llama_vocab as V, tandem.runtime.backends.llama as L\n"
              "V.NO_FD_REDIRECT = L.NO_FD_REDIRECT = False  # loads as before: fds 1 and 2 at /dev/null")
BACKEND_INIT = "import llama_cpp\nllama_cpp.llama_backend_init()"
A_CHILD = "import subprocess, sys as _s\nsubprocess.run([_s.executable, '-c', 'pass'])"
CLI_IMPORTS = ("import importlib\nfrom tandem.app.cli import build_parser\nbuild_parser()\n"
               "from tandem.runtime.planning.baseline import RUN_PATH_MODULES\n"
               "for _n in RUN_PATH_MODULES: importlib.import_module(_n)")
MEMORY_QUERY = "from tandem.runtime.backends.llama_devices import gpu_devices\nprint(gpu_devices())"
SECOND_GGML = ("import ctypes, llama_cpp\nllama_cpp.llama_backend_init()\nfrom llama_cpp import _ggml\n"
               "_l = _ggml.libggml\n_l.ggml_backend_dev_get.restype = ctypes.c_void_p\n"
               "_l.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]\n"
               "_l.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]\n"
               "_f, _t = ctypes.c_size_t(), ctypes.c_size_t()\n"
               "print(_l.ggml_backend_dev_count()); _l.ggml_backend_dev_memory(_l.ggml_backend_dev_get(0), "
               "ctypes.byref(_f), ctypes.byref(_t)); print(_f.value, _t.value)")
BASELINE = "from tandem.runtime.planning.baseline import _child\n_child()"


def diagnosis(model: str) -> list[tuple[str, list[str]]]:
    """One factor at a time around what crashed on an H200 (the process baseline child and
    the GPU test tier died in the model load; Tandem's backend alone did not)."""
    py = [sys.executable, "-X", "faulthandler"]

    def tiny(*before: str) -> list[str]:
        return py + ["-c", TINY.format(before="\n".join(before))]

    def ours(*before: str) -> list[str]:
        return py + ["-c", OURS.format(ngl=-1, fa=False, threads=None, before="\n".join(before), after=""), model]

    return [
        ("the process baseline child (as now)", py + ["-m", "tandem.runtime.planning.baseline"]),
        ("the baseline child, loads redirecting fds 1/2 (as before)", py + ["-c", REDIRECTED + "\n" + BASELINE]),
        ("tiny model after llama_backend_init()", tiny(BACKEND_INIT)),
        ("tiny model after llama_backend_init(), redirected loads", tiny(BACKEND_INIT, REDIRECTED)),
        ("tiny model after backend init and a child process", tiny(BACKEND_INIT, A_CHILD)),
        ("tiny model after backend init and a child, redirected", tiny(BACKEND_INIT, A_CHILD, REDIRECTED)),
        ("tiny model after the CLI's imports", tiny(CLI_IMPORTS)),
        # which of those imports (the H200 run: the CLI's imports, no torch, killed the load)
        ("tiny model after importing tandem.app.cli only", tiny("import tandem.app.cli")),
        ("tiny model after building the CLI's parser", tiny("from tandem.app.cli import build_parser\nbuild_parser()")),
        ("tiny model after the run path's modules", tiny("import importlib\n" + CLI_IMPORTS.split("\n", 3)[3])),
        ("tiny model after importing llguidance", tiny("import llguidance, llguidance._lib")),
        ("tiny model after importing textual", tiny("import textual.app, textual.widgets")),
        ("tiny model after importing huggingface_hub", tiny("import huggingface_hub")),
        ("tiny model after importing the server stack", tiny("import starlette.applications, uvicorn, sse_starlette")),
        ("tiny model after torch's CUDA context", tiny(TORCH_FIRST)),
        ("all on GPU after the memory query (libllama's ggml)", ours(MEMORY_QUERY)),
        ("all on GPU after the memory query through llama_cpp._ggml", ours(SECOND_GGML)),
        ("all on GPU after the memory query through _ggml, redirected", ours(SECOND_GGML, REDIRECTED)),
        ("all on GPU after torch's CUDA context", ours(TORCH_FIRST)),
        ("tandem run --draft-mode off", py + ["-m", "tandem.app.cli", "run", "-m", model, "-p", "def fib(n):",
                                              "-n", "16", "--raw", "--json", "--draft-mode", "off"]),
    ]


def variants(model: str, threads: int) -> list[tuple[str, list[str]]]:
    py = [sys.executable, "-X", "faulthandler"]

    def ours(ngl: int = -1, fa: bool = False, n_threads: int | None = None, before: str = "", after: str = ""):
        return py + ["-c", OURS.format(ngl=ngl, fa=fa, threads=n_threads, before=before, after=after), model]

    return [
        ("llama-cpp-python Llama, all layers on the GPU", py + ["-c", PEER.format(ngl=-1), model]),
        ("llama-cpp-python Llama, no GPU layers", py + ["-c", PEER.format(ngl=0), model]),
        ("Tandem backend (exact), all layers on the GPU", ours()),
        ("Tandem backend (exact), no GPU layers", ours(ngl=0)),
        ("... all on GPU, llama.cpp's own logger (no Python callback)", ours(after=DEFAULT_LOG)),
        ("... all on GPU, flash attention on", ours(fa=True)),
        ("... all on GPU, 1 thread", ours(n_threads=1)),
        (f"... all on GPU, {threads} threads", ours(n_threads=threads)),
        ("... all on GPU, torch's CUDA context made first", ours(before=TORCH_FIRST)),
        ("... all on GPU, use_extra_bufts on (the peer's default)",
         ours(after=patched("model_params", "p.use_extra_bufts = True"))),
        ("... all on GPU, flash attention auto (the peer's default)",
         ours(after=patched("context_params", "p.flash_attn_type = -1"))),
        ("... all on GPU, kv_unified on", ours(after=patched("context_params", "p.kv_unified = True"))),
        ("... all on GPU, perf counters on", ours(after=patched("context_params", "p.no_perf = False"))),
        ("... all on GPU, n_ubatch 512 as the peer",
         ours(after=patched("context_params", "p.n_batch = p.n_ubatch = 512"))),
        ("tiny F32 model on the CPU, as the baseline child runs it", py + ["-c", TINY.format(before="")]),
        ("the process baseline child", py + ["-m", "tandem.runtime.planning.baseline"]),
        ("tandem run --draft-mode off", py + ["-m", "tandem.app.cli", "run", "-m", model, "-p", "def fib(n):",
                                              "-n", "16", "--raw", "--json", "--draft-mode", "off"]),
        ("tandem run --draft-mode ngram", py + ["-m", "tandem.app.cli", "run", "-m", model, "-p", "def fib(n):",
                                                "-n", "16", "--raw", "--json", "--draft-mode", "ngram"]),
    ]


def crash_frame(stderr: str) -> str:
    """The innermost Python frame faulthandler printed (the line after its header)."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("Current thread", "Thread 0x")) and i + 1 < len(lines):
            return lines[i + 1].strip()
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout", type=float, default=90.0, help="for all variants together (they run at once)")
    ap.add_argument("--diagnosis", action="store_true", help="the one-factor variants around the crash found")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = diagnosis(args.model) if args.diagnosis else variants(args.model, os.cpu_count() or 1)
    # Every variant at once (crashes, not timings, are looked for): the whole bisection takes
    # as long as its slowest child. Each child logs llama.cpp's whole output to its stderr.
    env = {**os.environ, "TANDEM_LLAMA_LOG": "1"}
    start = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _, cmd in todo]
    results = []
    for (name, _), proc in zip(todo, procs, strict=True):
        try:
            _, err = proc.communicate(timeout=max(1.0, args.timeout - (time.perf_counter() - start)))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            rc = None
        said = "ok" if rc == 0 else ("hung" if rc is None else child_failure("child", rc, ""))
        results.append({"variant": name, "returncode": rc, "result": said, "frame": crash_frame(err),
                        "seconds": round(time.perf_counter() - start, 1), "stderr_tail": err[-4000:]})
        print(f"{said[:60]:60}  {name}" + (f"\n{'':60}  at {results[-1]['frame']}" if results[-1]["frame"] else ""),
              flush=True)
        if rc != 0:
            tail = [line for line in err.splitlines() if line.strip()][-6:]
            print("\n".join(f"{'':62}| {line[:150]}" for line in tail), flush=True)
    (out / "gpu_crash_bisect.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
