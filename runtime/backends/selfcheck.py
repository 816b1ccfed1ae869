"""Does llama.cpp, as built on this machine, run quantized models? Checked in a child process.

A llama.cpp build can compile code paths the CPU then executes wrongly: with
``GGML_NATIVE=ON`` on an Intel AMX CPU, every quantized model segfaults at its first
decode (ggml-org/llama.cpp#20824). A segfault in a test or in a user's first chat says
nothing useful, so setup ends with this check: a tiny Llama model with random weights
is written, quantized with llama.cpp's own quantizer to the types real models use
(Q4_0, Q4_K, Q6_K, Q8_0), and a child process loads each and decodes a few tokens. A
build that offloads (llama.cpp lists a GPU, :mod:`tandem.runtime.backends.llama_devices`)
decodes each on the GPU too, every layer offloaded. A crash is reported as one message
naming the cause (a signal by name) and the fix.

``python -m tandem.runtime.backends.selfcheck`` exits 0 when all runs, 1 otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tandem.errors import child_failure
from tandem.models.python_child import code_argv
from tandem.runtime.backends import llama_devices

QUANT_TYPES = ("q4_0", "q4_1", "q4_k_m", "q8_0")
"""q4_k_m also writes Q6_K tensors: together these cover the kernels real GGUFs use."""

N_EMBD, N_FF, N_LAYER, N_HEAD, N_VOCAB = 256, 512, 2, 4, 259


def add_byte_vocab(writer) -> int:
    """A byte-level SentencePiece-style vocabulary (``<unk>``, ``<s>``, ``</s>`` and the 256
    byte tokens) on a ``gguf.GGUFWriter``; returns its size (:data:`N_VOCAB`)."""
    import gguf  # local: gguf's writer only when a tiny model is written

    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.BYTE] * 256)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    return len(tokens)


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """An F32 Llama GGUF (random weights, byte-level SentencePiece-style vocabulary) whose
    rows are multiples of 256, so every quantization type applies to every matrix."""
    import gguf  # local: gguf's reader only when a file is read here

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tandem-selfcheck")
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_byte_vocab(w)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(N_VOCAB, N_EMBD))
    for i in range(N_LAYER):
        for name, shape in (("attn_q", (N_EMBD, N_EMBD)), ("attn_k", (N_EMBD, N_EMBD)),
                            ("attn_v", (N_EMBD, N_EMBD)), ("attn_output", (N_EMBD, N_EMBD)),
                            ("ffn_gate", (N_FF, N_EMBD)), ("ffn_up", (N_FF, N_EMBD)),
                            ("ffn_down", (N_EMBD, N_FF))):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output.weight", mat(N_VOCAB, N_EMBD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def decode_in_child(path: Path, timeout_s: float = 120.0, n_gpu_layers: int = 0) -> str | None:
    """Load ``path`` and decode 8 tokens in a child process (``n_gpu_layers=-1``: all on the
    GPU); ``None`` if that worked, else what went wrong (a signal, an error message, a hang)."""
    code = (
        "import sys, numpy as np\n"
        "from tandem.runtime.backends.llama import LlamaCppBackend, LlamaConfig\n"
        "b = LlamaCppBackend(sys.argv[1], LlamaConfig(n_ctx=64, n_threads=1, n_gpu_layers=int(sys.argv[2])))\n"
        "logits = b.evaluate([1, 72, 101, 108, 108, 111], logits_for=range(6))\n"
        "for _ in range(8): logits = b.evaluate([int(np.argmax(logits[-1]))])\n"
        "assert np.isfinite(logits).all(), 'non-finite logits'\n"
    )
    try:
        done = subprocess.run(code_argv(code, str(path), str(n_gpu_layers)), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"decoding hung for {timeout_s:.0f} s"
    return describe_exit(done.returncode, done.stderr)


def describe_exit(returncode: int, stderr: str) -> str | None:
    """``None`` for success, else one line: the signal that killed the child by name, or
    its last line of error output (:func:`tandem.errors.child_failure`)."""
    if returncode == 0:
        return None
    return child_failure("decoding child", returncode, stderr)


def batch_step_difference(backend, ids: list[int], m: int) -> float:
    """Max |logit difference| between the last ``m`` of ``ids`` evaluated as one batch and
    as ``m`` one-token steps, after the same prefix (0.0: bit-identical). What greedy
    identity of speculative decoding rests on (see ``Backend.exact_batch``)."""
    head, tail = ids[:-m], ids[-m:]
    backend.truncate(0)
    backend.evaluate(head)
    batch = backend.evaluate(tail, logits_for=range(m))
    backend.truncate(len(head))
    steps = np.stack([backend.evaluate([t])[0] for t in tail])
    return float(np.abs(batch - steps).max())


def run_selfcheck(on_gpu: bool | None = None) -> list[str]:
    """One problem line per quantization type and device that does not run (empty: all
    fine). ``on_gpu``: also decode with every layer on the GPU (default: when this build
    offloads)."""
    # local: loads the gguf package only when this runs
    from tandem.models.quantize import quantize_gguf

    if on_gpu is None:

        on_gpu = llama_devices.gpu_offload_build()
    problems = []
    with tempfile.TemporaryDirectory(prefix="tandem-selfcheck-") as tmp:
        f32 = write_tiny_llama(Path(tmp) / "tiny-f32.gguf")
        for qtype in QUANT_TYPES:
            out = Path(tmp) / f"tiny-{qtype}.gguf"
            quantize_gguf(f32, out, qtype)
            for where, layers in (("CPU", 0), ("GPU", -1))[: 2 if on_gpu else 1]:
                problem = decode_in_child(out, n_gpu_layers=layers)
                if problem:
                    problems.append(f"{qtype} on the {where}: {problem}")
    return problems


ADVICE = (
    "llama.cpp, as built here, cannot run quantized models on this CPU. The usual cause is a\n"
    "build for the wrong instruction set (e.g. GGML_NATIVE=ON with AMX on Intel Xeon:\n"
    "ggml-org/llama.cpp#20824). Rebuild with the flags packaging/cpu_flags.sh prints:\n"
    '  CMAKE_ARGS="$(bash packaging/cpu_flags.sh)" pip install --force-reinstall --no-cache-dir \\\n'
    "      --no-binary llama-cpp-python llama-cpp-python==0.3.36\n"
    "(bash packaging/bootstrap.sh does this; remove ~/.cache/tandem-build to force a rebuild)."
)
GPU_ADVICE = (
    "llama.cpp, as built here, cannot run quantized models on this GPU. Check that the driver\n"
    "supports the CUDA toolkit the build used (nvidia-smi, nvcc --version), or build for the CPU\n"
    "only: TANDEM_CUDA=0 bash packaging/bootstrap.sh"
)


def main() -> int:
    os.environ.setdefault("TANDEM_LLAMA_LOG", "")

    on_gpu = llama_devices.gpu_offload_build()
    problems = run_selfcheck(on_gpu)
    if not problems:
        where = "this CPU"
        if on_gpu:
            where += " and on the GPU (" + ", ".join(f"{d.name}: {d.description}" for d in llama_devices.gpu_devices()) + ")"
        print(f"self-check: llama.cpp runs {', '.join(QUANT_TYPES)} models on {where}")
        return 0
    advice = "\n".join(a for a, tag in ((ADVICE, " on the CPU: "), (GPU_ADVICE, " on the GPU: "))
                       if any(tag in p for p in problems))
    print("self-check FAILED:\n  " + "\n  ".join(problems) + "\n" + advice, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
