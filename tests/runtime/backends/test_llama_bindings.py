"""llama.cpp's C API without llama-cpp-python's high-level package, and the
end-of-generation scan through it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tandem.models.python_child import module_argv


def test_the_scan_finds_what_llama_cpp_answers_token_by_token(real_models) -> None:
    """The fast pass (no argument conversion) against the binding's own call, on a
    151k-token vocabulary whose end-of-generation tokens include one that is not a
    control token in the file (``</s>``, made one by llama.cpp)."""
    import llama_cpp

    from tandem.runtime.backends.llama_bindings import end_of_generation
    from tandem.runtime.backends.llama_vocab import LlamaVocab

    vocab = LlamaVocab.open(real_models.qwen_15b)
    try:
        handle, n = vocab.model.vocab, vocab.n_vocab
        slow = [t for t in range(n) if llama_cpp.llama_vocab_is_eog(handle, t)]
        assert end_of_generation(llama_cpp, handle, n) == slow
        assert len(slow) >= 2 and vocab.special.eos in slow
    finally:
        vocab.close()


def test_a_child_gets_the_c_functions_without_the_high_level_api(stories260k: Path) -> None:
    """``bindings_only`` in a fresh process: ``import llama_cpp`` answers with the C
    functions, and neither numpy nor jinja2 nor ``llama_cpp.llama`` is imported."""
    code = (
        "import sys, json\n"
        "from tandem.runtime.backends.llama_bindings import bindings_only\n"
        "L = bindings_only()\n"
        "import llama_cpp\n"
        "from tandem.runtime.backends.llama_config import LlamaConfig, model_params\n"
        "p = model_params(LlamaConfig()); p.vocab_only = True\n"
        "m = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), p)\n"
        "n = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m))\n"
        "heavy = sorted(k for k in sys.modules if k.split('.')[0] in ('numpy', 'jinja2') or k == 'llama_cpp.llama')\n"
        "print(json.dumps({'same': L is llama_cpp, 'n': n, 'heavy': heavy}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(stories260k)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"same": True, "n": 512, "heavy": []}


def test_the_sizing_child_imports_no_high_level_api(stories260k: Path) -> None:
    """The sizing child answers (its first line and a context) with llama-cpp-python's
    high-level package, numpy and jinja2 never imported: they were 0.2-0.3 s of CPU
    on the way to a first run's model load."""
    argv = module_argv("tandem.runtime.planning.llama_sizes", str(stories260k))
    done = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], input='{"n_ctx": 256, "n_batch": 64}\n',
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    first, context = (json.loads(line) for line in done.stdout.splitlines())
    assert first["runtime"] > 0 and first["eog"] and context["compute"] > 0
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "llama_cpp._ctypes_extensions" in imported  # by the bindings (import_module itself is not timed)
    assert not {m for m in imported if m.split(".")[0] in ("numpy", "jinja2") or m == "llama_cpp.llama"}
