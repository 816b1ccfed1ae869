"""What llama.cpp itself allocates for a model and a context, asked of llama.cpp.

The memory model must not guess llama.cpp's compute buffer (its graph allocator packs
hundreds of tensors; a formula fitted on one build misses on the next) or the heap its
model loader keeps (vocabulary, merges, tensor metadata). Both are read here from
llama.cpp, in a child process, without loading any weights:

* the model is loaded with ``no_alloc`` (llama.cpp's "memory-fit" mode: metadata only,
  allocations simulated) — the child's growth in anonymous resident memory is the
  model's **runtime** (vocabulary, merges, tensor metadata, backend setup);
* a context is created for each setup asked about, also simulated; llama.cpp logs the
  size its scheduler reserved for the compute buffer, which is what a real context
  allocates. ``n_outputs_max`` is set to the rows of logits the caller will ask for:
  without it llama.cpp reserves room for ``n_batch`` rows of logits (150 MB for a
  151k vocabulary at batch 256), pages a run that asks for a few rows never touches.
  With it, the reservation is the high-water mark of the largest graph a run reaches
  (a full ubatch at a full context), so a filled context touches all of it.

Each answer takes a few milliseconds once the child has read the model's metadata
(~0.7 s for a 151k vocabulary), so the child stays up while a plan is made
(:func:`sizes_for`; :func:`close_all` ends it) and the answers are cached on disk per
model file, machine and software (:func:`cache_path`). Run as
``python -m tandem.runtime.planning.llama_sizes MODEL.gguf``: reads one JSON setup per line,
writes one JSON answer per line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tandem.errors import TandemError, child_failure
from tandem.models.paths import cache_dir, write_cache_file
from tandem.models.python_child import module_argv
from tandem.runtime.backends import file_facts
from tandem.runtime.machine import cache_key, file_version, machine_id, software_id

SIZES_VERSION = 1
"""Bumped when what is measured changes, so older cache files are measured again."""


@dataclass(frozen=True)
class ContextSetup:
    """The context parameters that move llama.cpp's buffers."""

    n_ctx: int
    n_batch: int
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    outputs: int = 1

    def key(self) -> str:
        return f"{self.n_ctx}/{self.n_batch}/{self.type_k}/{self.type_v}/{int(self.flash_attn)}/{self.outputs}"


@dataclass(frozen=True)
class ContextSizes:
    compute: int
    """Bytes of llama.cpp's host compute buffer (the scheduler's reservation)."""
    output: int
    """Bytes of its output buffer at creation (grows to ``outputs`` rows when asked)."""
    context: int
    """Anonymous resident bytes the context's own structures took in the child."""


def cache_path(model: Path) -> Path:
    """The cache file of one model file: keyed by the file's version, the machine and
    its software (llama.cpp's version among them), so a changed file or an upgraded
    llama.cpp is measured again."""
    return cache_dir() / "llama-sizes" / f"{cache_key(file_version(model), machine_id(), software_id(), SIZES_VERSION)}.json"


_MEMO: dict[str, dict] = {}
"""Answers already known to this process, by cache file name."""


class LlamaSizes:
    """llama.cpp's sizes for one GGUF file: answers from the disk cache, else from a
    child process started on the first miss and kept until :meth:`close`."""

    def __init__(self, model: str | os.PathLike[str], *, persist: bool = True) -> None:
        self.model = Path(model)
        self._persist = persist
        self._cache_file = cache_path(self.model)
        # One answer per process too (tests give every test its own cache dir).
        self._cache: dict = _MEMO.setdefault(self._cache_file.name, {})
        if not self._cache:
            with contextlib.suppress(OSError, ValueError):
                self._cache.update(json.loads(self._cache_file.read_text()))
        self._proc: subprocess.Popen | None = None
        self._read_runtime = False
        """Whether the child's first line was read (it may have been spawned early)."""
        self._dirty = False

    @property
    def runtime(self) -> int:
        """Anonymous resident bytes llama.cpp keeps for the loaded model (no weights)."""
        if "runtime" not in self._cache:
            self._start()
        return int(self._cache["runtime"])

    def context(self, setup: ContextSetup) -> ContextSizes:
        hit = self._cache.get("contexts", {}).get(setup.key())
        if hit is None:
            self._start()
            assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(asdict(setup)) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            if not line:
                self._fail()
            hit = json.loads(line)
            if "error" in hit:
                raise TandemError(f"llama.cpp cannot make a context for {self.model.name} ({setup}): {hit['error']}")
            self._cache.setdefault("contexts", {})[setup.key()] = hit
            self._dirty = True
        return ContextSizes(int(hit["compute"]), int(hit["output"]), int(hit["context"]))

    def start_soon(self) -> None:
        """Start the child now when the cache lacks this model, so it loads beside the
        other measurements of a first run; its answers are read when asked for."""
        if "runtime" not in self._cache:
            self._spawn()

    def _spawn(self) -> None:
        if self._proc is None:
            self._read_runtime = False
            self._proc = subprocess.Popen(
                module_argv("tandem.runtime.planning.llama_sizes", str(self.model)),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )

    def _start(self) -> None:
        """A child ready for questions: spawned if need be, its first line (the runtime
        heap it measured) read."""
        if self._proc is not None and self._read_runtime:
            return
        self._spawn()
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._fail()
        self._read_runtime = True
        first = json.loads(line)
        # A child started for a new context setup measures the runtime heap again; the
        # first measurement stays, so one model's figures never move within a process
        # (resident-memory noise of a few KiB once turned a suggested budget into a refusal).
        if "runtime" not in self._cache:
            self._cache["runtime"] = first["runtime"]
            self._dirty = True
        if self._persist:
            file_facts.remember(self.model, file_facts.EOG_TOKENS, first["eog"])

    def _fail(self) -> None:
        """The child closed its output: say how it ended (a signal by name)."""
        why = "the probe exited"
        if self._proc is not None:
            proc, self._proc = self._proc, None
            try:
                returncode: int | None = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # alive, but answering nothing
                proc.kill()
                proc.wait()
                returncode = None
            err = (proc.stderr.read() if proc.stderr else "").strip()
            if os.environ.get("TANDEM_LLAMA_LOG") and returncode is not None and returncode > 0:
                why = err or "the probe exited"  # llama.cpp's whole log, as asked
            else:  # one line: the child's last (llama.cpp's reason), or the signal by name
                why = child_failure("llama.cpp sizing child", returncode, err[-500:])
        raise TandemError(f"Could not read llama.cpp's buffer sizes for {self.model}: {why}")

    def close(self) -> None:
        """End the child (if any) and write what it answered to the cache."""
        if self._proc is not None:
            # Killed, not asked to exit: every answer it gave is read, and llama.cpp's
            # teardown would take a core for 0.1-0.2 s just as the plan's model loads
            # (measured on a new pair's first run, two children, 2 cores).
            proc, self._proc = self._proc, None
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self._dirty and self._persist:
            write_cache_file(self._cache_file, json.dumps(self._cache))
            self._dirty = False


_OPEN: dict[str, LlamaSizes] = {}


def sizes_for(model: str | os.PathLike[str]) -> LlamaSizes:
    """The process-wide :class:`LlamaSizes` of ``model`` (one child per file at most)."""
    key = str(Path(model).resolve())
    if key not in _OPEN:
        _OPEN[key] = LlamaSizes(model)
    return _OPEN[key]


def close_all() -> None:
    """End every sizing child and flush the caches (the planner calls this when done)."""
    while _OPEN:
        _OPEN.popitem()[1].close()


# -- the child ---------------------------------------------------------------------------
def _rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _serve(model: str) -> int:
    """Answer size questions about ``model`` (see the module docstring)."""
    # llama.cpp's C functions only (not llama-cpp-python's high-level API, numpy, jinja2):
    # on a first run this child's start is on the way to the model's load.
    from tandem.runtime.backends.llama_bindings import bindings_only

    llama_cpp = bindings_only()
    from tandem.runtime.backends import llama_log

    try:
        return _answer(llama_cpp, model)
    finally:
        # The callback _answer installed dies with its frame: llama.cpp must not keep a
        # pointer to it (a context or backend freed at exit logs through it).
        llama_log.install()


def _answer(llama_cpp: Any, model: str) -> int:
    from tandem.runtime.backends.llama_bindings import end_of_generation
    from tandem.runtime.backends.llama_config import LlamaConfig, context_params, model_params

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    before = _rss_anon()
    # The backend's own parameters, so what is sized is what it will open.
    mp = model_params(LlamaConfig())
    mp.no_alloc = True
    mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # no mapping: the memory-fit pass reads metadata only
    mp.n_gpu_layers = 0
    handle = llama_cpp.llama_model_load_from_file(model.encode(), mp)
    if not handle:
        print(load_error(f"llama.cpp could not load {model}", lines), file=sys.stderr)
        return 1
    vocab = llama_cpp.llama_model_get_vocab(handle)
    # What the backend builds on top: the end-of-generation tokens (a pass over the
    # vocabulary), the coverage guard and a tokenize/detokenize round.
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    eog = end_of_generation(llama_cpp, vocab, n_vocab)
    _first_use(llama_cpp, handle, vocab, n_vocab)
    # The parent keeps the end-of-generation tokens as the file's fact, so its own load
    # of the model does not pass over the vocabulary again.
    print(json.dumps({"runtime": _rss_anon() - before, "eog": eog}), flush=True)
    for raw in sys.stdin:
        setup = ContextSetup(**json.loads(raw))
        cfg = LlamaConfig(n_ctx=setup.n_ctx, n_batch=setup.n_batch, type_k=setup.type_k, type_v=setup.type_v,
                          flash_attn=setup.flash_attn)
        cp = context_params(cfg, setup.n_ctx, 1)
        cp.n_outputs_max = min(setup.outputs, cp.n_batch)
        lines.clear()
        start = _rss_anon()
        ctx = llama_cpp.llama_init_from_model(handle, cp)
        if not ctx:
            print(json.dumps({"error": "".join(lines[-3:]).strip() or "context creation failed"}), flush=True)
            continue
        context = _rss_anon() - start
        compute = _logged_mib(lines, "compute buffer size")
        output = _logged_mib(lines, "output buffer size")
        llama_cpp.llama_free(ctx)
        print(json.dumps({"compute": compute, "output": output, "context": context}), flush=True)
    llama_cpp.llama_model_free(handle)
    return 0


FIRST_USE_TEXT = "def main():\n    print('Hello, world!')  # ünïcödé ✓\n" * 4


def _first_use(llama_cpp: Any, handle: int, vocab: int, n_vocab: int) -> None:
    """What the backend does with a vocabulary before its first reply: the coverage guard
    (:func:`~tandem.runtime.backends.llama_bindings.byte_coverage`) and a
    tokenize/detokenize round of text the vocabulary covers."""
    from tandem.runtime.backends.llama_bindings import byte_coverage

    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(handle, b"tokenizer.ggml.model", buf, len(buf))
    covers = byte_coverage(llama_cpp, vocab, n_vocab, buf.value.decode() if n >= 0 else None)
    text = FIRST_USE_TEXT if covers is None else "".join(ch for ch in FIRST_USE_TEXT if covers(ch))
    raw = text.encode()
    ids = (llama_cpp.llama_token * (len(raw) + 8))()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), ids, len(ids), False, False)
    piece = ctypes.create_string_buffer(256)
    for t in ids[:max(n, 0)]:
        llama_cpp.llama_token_to_piece(vocab, t, piece, len(piece), 0, False)


def load_error(error: str, log: list[str]) -> str:
    """One line: ``error`` and the reason llama.cpp logged (``error loading model: ...``);
    with ``TANDEM_LLAMA_LOG=1`` its whole log before it."""
    if os.environ.get("TANDEM_LLAMA_LOG"):
        return "".join(log) + error
    marker = "error loading model: "
    reasons = [line.split(marker)[-1].strip() for line in log if marker in line]
    reason = reasons[-1].removeprefix("error loading model ") if reasons else ""
    return f"{error} ({reason})" if reason and reason not in error else error


def _logged_mib(lines: list[str], what: str) -> int:
    """Bytes of the host buffers llama.cpp logged as ``... <what> = X MiB`` (the log
    rounds to 0.01 MiB: rounded up here)."""

    total = 0.0
    for line in lines:
        if what in line and "=" in line and ("CPU" in line or "Host" in line):
            total += float(line.rsplit("=", 1)[1].split()[0])
    return math.ceil((total + 0.005) * 1024 * 1024)


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1]))


def work_buffer(n_batch: int, cells: int, n_embd: int, n_ff: int, n_head: int, type_v: str = "f16",
                flash_attn: bool = False) -> int:
    """The CPU backend's work buffer for the largest matmul of a full ubatch of
    ``n_batch`` tokens over ``cells`` KV cells: it converts the right-hand operand to the
    kernel's type first. Without flash attention that is the attention scores (cells ×
    batch × heads) turned into f16 for an f16/bf16 V cache (llama.cpp's ``ggml_mul_mat``
    of V by softmax(KQ)); otherwise the widest activation (at most 4 bytes an element:
    an upper bound for the quantized kernels' ~1.1)."""
    flash = flash_attn or type_v not in ("f16", "f32", "bf16")
    scores = 0 if flash or type_v == "f32" else 2 * n_batch * cells * n_head
    return max(scores, 4 * n_batch * max(n_ff, n_embd))
