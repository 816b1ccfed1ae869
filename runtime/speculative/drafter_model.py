"""The drafter's model: opened now (:func:`open_draft_backend`), or when the adaptive
policy first asks it for a draft (:func:`deferred_draft_backend`), and made into a
same- or cross-vocabulary drafter (:func:`open_model_drafter`)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.errors import TandemError
from tandem.runtime.backends.deferred import DeferredBackend, DrafterUnavailable
from tandem.runtime.backends.opener import backend_kind, open_backend
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.speculative.cost_cache import (
    cached_cost_curve,
    cached_drafter_costs,
    times_drafter_call,
)
from tandem.runtime.speculative.drafters.base import Drafter
from tandem.runtime.speculative.drafters.model import ModelDrafter, same_vocabulary
from tandem.runtime.speculative.drafters.xvocab.drafter import CrossVocabDrafter

if TYPE_CHECKING:
    from tandem.runtime.speculative.factory import SpecOptions


def open_draft_backend(target: Backend, draft: str | Path, *, llama_config=None, device: str = "cpu",
                       torch_config=None) -> Backend:
    """The drafter model's backend: on ``cuda`` the torch engine (warmed up), else what
    its file type implies (``llama_config`` for a GGUF, the target's context otherwise)."""
    from tandem.models.store import resolve_model  # local: gguf loads only when a drafter is opened

    path = resolve_model(str(draft))
    if device != "cuda":
        return open_backend(path, n_ctx=target.n_ctx, llama_config=llama_config)
    from tandem.runtime.backends.torch_engine.backend import (  # local: torch, an extra
        TorchBackend,
        TorchConfig,
    )

    backend = TorchBackend(path, torch_config or TorchConfig(device="cuda", n_ctx=target.n_ctx + 16))
    backend.evaluate([backend.special.bos or 0])  # first CUDA launches (kernels, cuBLAS) are slow:
    backend.truncate(0)  # pay them here, not in the first round the adaptive policy times
    return backend


def deferred_draft_backend(target: Backend, draft: Path, options: SpecOptions, *,
                           llama_config=None) -> DeferredBackend | None:
    """The drafter model as a backend opened when the adaptive policy first asks it for a
    draft (:mod:`tandem.runtime.backends.deferred`), or ``None`` where it must open now:

    * the two files do not store the same vocabulary (a cross-vocabulary drafter builds
      its translation from both when the strategy is built; one stored differently may
      still match, which only an open model can tell);
    * the cost guess is about to time one call of its model (the target's step is known
      here, the drafter's costs are not yet);
    * a GPU drafter (it is warmed up when opened), a fixed draft length (it drafts every
      round), a model that is not a GGUF file.

    The vocabularies are compared again, through llama.cpp, when the model opens.
    """
    target_file = target.compute_settings().model_file
    if (options.mode not in ("auto", "model") or options.draft_device != "cpu" or options.draft_length is not None
            or backend_kind(draft) != "gguf" or target_file is None or backend_kind(target_file) != "gguf"):
        return None
    # Local: the GGUF reader and the model store load only when a drafter is named.
    from tandem.models.gguf_file import inspect_gguf
    from tandem.models.store import resolve_model

    try:
        draft = resolve_model(str(draft))
        info = inspect_gguf(draft)
        same = info.vocabulary() is not None and info.vocabulary() == inspect_gguf(target_file).vocabulary()
    except TandemError:  # opened now, it says what is wrong with the file
        return None
    if not same:
        return None
    if options.measure_cost:
        learnt = cached_drafter_costs(target, f"model:{draft.stem}", info.weights_bytes)
        curve = cached_cost_curve(target, options.draft_max)
        if times_drafter_call(options.draft_cost, learnt, curve.t1_s if curve else None):
            return None

    def check(backend: Backend) -> None:
        if not same_vocabulary(target, backend):
            raise DrafterUnavailable(f"The drafter {backend.name} does not have {target.name}'s vocabulary.")

    n_ctx = (llama_config.n_ctx if llama_config is not None else None) or target.n_ctx
    return DeferredBackend(draft, n_ctx=n_ctx, weights=info.weights_bytes, check=check,
                           opener=partial(open_draft_backend, target, draft, llama_config=llama_config))


def open_model_drafter(target: Backend, draft: str | Path | Backend, mode: str, *, llama_config=None,
                       device: str = "cpu", torch_config=None) -> Drafter:
    """A model drafter for ``draft`` (a GGUF path, a store name or an open backend, which
    stays the caller's): same-vocabulary when the vocabularies match, cross-vocabulary
    otherwise (``auto``), or as ``mode`` demands. A deferred backend not yet opened
    (:func:`deferred_draft_backend`) stands for a same-vocabulary drafter."""
    if isinstance(draft, DeferredBackend) and not draft.is_open:  # before Backend: its checks would open it
        return ModelDrafter(draft, owns_backend=False)
    owns = not isinstance(draft, Backend)
    backend = (open_draft_backend(target, draft, llama_config=llama_config, device=device, torch_config=torch_config)
               if owns else draft)
    try:
        same = same_vocabulary(target, backend)
        if mode == "model" and not same:
            raise TandemError(
                f"The drafter {backend.name} has a different vocabulary from {target.name}: "
                "use --draft-mode xvocab (or auto)."
            )
        if mode == "model" or (mode == "auto" and same):
            return ModelDrafter(backend, owns_backend=owns)
        return CrossVocabDrafter(backend, target, owns_backend=owns)
    except BaseException:
        if owns:
            backend.close()
        raise
