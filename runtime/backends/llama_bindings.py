"""llama.cpp's C API through llama-cpp-python's ctypes bindings alone.

``import llama_cpp`` runs the package's ``__init__``, which imports its high-level API
too (``Llama``, the chat formats, numpy, jinja2): 0.2-0.3 s of CPU. A child process that
only asks llama.cpp about a file (:mod:`tandem.runtime.planning.llama_sizes`) needs the
C functions and nothing else, and on a first run that import sits on the critical path
before the model can load. :func:`bindings_only` gives it them in 0.05 s.

:func:`end_of_generation` and :func:`byte_coverage` are the vocabulary passes both the
child and the backend make.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import itertools
import sys
import types
from collections.abc import Callable
from typing import Any

from tandem.models.vocab_coverage import coverage_check


def bindings_only() -> Any:
    """The module ``llama_cpp`` as llama.cpp's ctypes bindings alone, also installed as
    ``sys.modules["llama_cpp"]`` so modules that ``import llama_cpp`` for its C functions
    (:mod:`~tandem.runtime.backends.llama_config`, :mod:`~tandem.runtime.backends.llama_log`)
    work unchanged. For a fresh child process only: a process that already imported the
    full package keeps it (and then gets it back), and one that imports the high-level API
    after this call would find it missing."""
    loaded = sys.modules.get("llama_cpp")
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("llama-cpp-python is not installed")
    package = types.ModuleType("llama_cpp")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["llama_cpp"] = package
    try:
        bindings = importlib.import_module("llama_cpp.llama_cpp")
    except BaseException:
        del sys.modules["llama_cpp"]
        raise
    package.__dict__.update({k: v for k, v in vars(bindings).items() if not k.startswith("__")})
    return package


def end_of_generation(llama_cpp: Any, vocab: int, n_vocab: int) -> list[int]:
    """The tokens llama.cpp ends generation on, ascending: a pass over the vocabulary.

    llama.cpp exposes the set only token by token (``llama_vocab_is_eog``), and its
    binding converts both arguments on every call. The same C function called through a
    prototype without argument types (the vocabulary passed once as a pointer object, ids
    as C ints) takes half the time: 0.08 s for Qwen2.5's 151,665 tokens against 0.15 s."""
    address = ctypes.cast(llama_cpp.llama_vocab_is_eog, ctypes.c_void_p).value
    is_eog = ctypes.CFUNCTYPE(ctypes.c_bool)(address)
    ids = range(n_vocab)
    return list(itertools.compress(ids, map(is_eog, itertools.repeat(ctypes.c_void_p(vocab), n_vocab), ids)))


def byte_coverage(llama_cpp: Any, vocab: int, n_vocab: int, tokenizer_model: str | None) -> Callable[[str], bool] | None:
    """Which characters the vocabulary can tokenize (``None``: all of them), from its
    tokens' texts, read only until every byte's token is seen
    (:func:`tandem.models.vocab_coverage.coverage_check`): llama.cpp aborts on text it
    cannot encode."""
    texts = (llama_cpp.llama_vocab_get_text(vocab, t).decode("utf-8", errors="replace") for t in range(n_vocab))
    return coverage_check(tokenizer_model, texts)
