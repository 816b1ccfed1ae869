"""`TorchBackend`: the backend protocol on the torch engine (CUDA when present, else CPU).

Beyond the protocol it offers what the research features need and llama.cpp hides:
``evaluate_embeddings`` (inputs_embeds), ``evaluate_tree`` + ``accept_path`` (verify
several candidate branches in one pass, each node attending exactly to its ancestors at
position = depth), a pluggable KV cache (``TorchConfig.cache_factory``) and direct
access to the module (``backend.model``) and cache (``backend.cache``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.errors import ModelNotFound, PromptError, TandemError
from tandem.runtime.backends.llama_vocab import TokenizerDelegate
from tandem.runtime.backends.protocol import (
    ComputeSettings,
    MemoryReport,
    check_room,
    chunked_logits,
    speed_settings,
)
from tandem.runtime.backends.token_cache import FixedTokenCache, new_tokens
from tandem.runtime.backends.torch_engine.cache import KVCache
from tandem.runtime.backends.torch_engine.config import ModelConfig
from tandem.runtime.backends.torch_engine.decoder import LlamaModel
from tandem.runtime.backends.torch_engine.loader import load_weights
from tandem.runtime.backends.torch_engine.tokenizer import load_tokenizer

MMAP_THRESHOLD = 4 * 1024**2
"""Host allocations at least this large get their own mapping, returned to the OS when freed."""


@functools.cache
def return_large_temporaries() -> bool:
    """Pin glibc's mmap threshold at :data:`MMAP_THRESHOLD` (once per process).

    glibc raises the threshold after large blocks are freed (up to 32 MiB), after which
    the engine's attention and activation temporaries come from the heap and stay
    resident: peak RSS then varies by ~40 % between identical runs and never shrinks
    (measured: stories260K at 2048 x 256 peaked at 66-73 MB; pinned, 50-53 MB). A budget
    the memory planner promises needs the pinned behaviour. 4 MiB keeps the per-step
    allocations of decoding (logits rows, one token's activations) on the heap, so
    decoding does not pay a map/unmap per step. No effect off glibc (returns False)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}

CacheFactory = Callable[[ModelConfig, torch.dtype, torch.device], KVCache]


def is_routed_expert(name: str) -> bool:
    """A routed expert stack (``blk.N.ffn_{gate,up,down}_exps.weight``), not the router or a shared expert."""
    return "_exps." in name


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def full_cache(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> KVCache:
    return KVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, dtype=dtype, device=device)


@dataclass(frozen=True)
class TorchConfig:
    device: str | None = None
    """``cuda``, ``cpu``, ``cuda:1``...; ``None`` picks CUDA when available."""
    dtype: str = "float32"
    """Weights, activations and KV dtype: float32 (default), float64 (exactness tests),
    float16/bfloat16 (GPU)."""
    n_ctx: int | None = None
    """Context length; ``None`` means the model's own, capped at 4096."""
    n_batch: int = 512
    """Longest chunk evaluated in one forward pass (bounds attention memory)."""
    n_threads: int | None = None
    cache_factory: CacheFactory | None = None
    """Builds the KV cache; ``None`` is the full-precision :class:`KVCache`."""
    lazy_experts: bool = False
    """A mixture-of-experts GGUF: leave the routed experts in the file (empty placeholders)
    for an expert offload (:func:`tandem.runtime.moe.expert_cache.enable_offload` with
    ``source="gguf"``) to serve, so loading never holds them all. The model cannot
    generate until the offload is in place."""


def tree_mask(parents: Sequence[int]) -> torch.Tensor:
    """(T, T) boolean: node i sees node j iff j is i or one of its ancestors.

    ``parents[i]`` is the index of i's parent among the new nodes, or -1 for a node
    whose parent is the last token already in the cache. Parents precede children.
    """
    t = len(parents)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree node {i} has parent {p}: parents must come before their children")
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def tree_depths(parents: Sequence[int]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


class TorchBackend(TokenizerDelegate, FixedTokenCache):
    """A Llama-family model on torch and its KV cache (see :class:`tandem.runtime.backends.protocol.Backend`)."""

    def __init__(self, path: str | os.PathLike[str], config: TorchConfig | None = None) -> None:
        return_large_temporaries()
        self.config = cfg = config or TorchConfig()
        if cfg.dtype not in DTYPES:
            raise TandemError(f"Unknown dtype {cfg.dtype!r}; choose one of {', '.join(DTYPES)}.")
        self.path = Path(path)
        if not self.path.exists():
            raise ModelNotFound(f"No model at {self.path}.")
        self.name = self.path.stem if self.path.is_file() else self.path.name
        self.device = torch.device(cfg.device or default_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise TandemError("CUDA was asked for but torch sees no CUDA device.")
        if cfg.n_threads:
            torch.set_num_threads(cfg.n_threads)
        self.dtype = DTYPES[cfg.dtype]
        self.tokenizer = load_tokenizer(self.path)
        skip = is_routed_expert if cfg.lazy_experts else None
        self.model_config, weights = load_weights(self.path, self.dtype, self.device, skip)
        self.model = LlamaModel(self.model_config, weights).eval()
        del weights
        self._n_ctx = cfg.n_ctx or min(self.model_config.n_ctx_train, 4096)
        self.cache = (cfg.cache_factory or full_cache)(self.model_config, self.dtype, self.device)
        self._tokens: list[int] = []
        self._tree: tuple[int, list[int]] | None = None

    # -- protocol -------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.model_config.n_vocab

    @property
    def n_embd(self) -> int:
        return self.model_config.n_embd

    def evaluate(self, tokens: Sequence[int], logits_for: Sequence[int] | None = None) -> np.ndarray:
        tokens = new_tokens(tokens)
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise PromptError(f"Token id {bad[0]} is outside the vocabulary of {self.n_vocab}.")
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            return self._chunked(self.model.embed(ids), tokens, logits_for)

    def evaluate_embeddings(self, embeds: np.ndarray | torch.Tensor, logits_for: Sequence[int] | None = None) -> np.ndarray:
        """Like :meth:`evaluate` with input embeddings (n, n_embd) instead of token ids.

        Positions are recorded in ``tokens`` as ``-1`` (no id describes a mixed input),
        so :func:`prefill` never reuses them.
        """
        x = torch.as_tensor(embeds).to(device=self.device, dtype=self.dtype)
        x = x.reshape(1, -1) if x.dim() == 1 else x
        if x.shape[0] == 0 or x.shape[1] != self.n_embd:
            raise ValueError(f"evaluate_embeddings needs rows of width {self.n_embd}, got shape {tuple(x.shape)}")
        with torch.inference_mode():
            return self._chunked(x, [-1] * x.shape[0], logits_for)

    def evaluate_tree(
        self, tokens: Sequence[int], parents: Sequence[int], logits_for: Sequence[int] | None = None
    ) -> np.ndarray:
        """Evaluate a token tree in one pass; logits for ``logits_for`` nodes (default all).

        Node i attends to the cached tokens and to its own ancestors only, at position
        ``len(cache) + depth(i)``, so its logits equal those of evaluating its branch
        alone. Afterwards the cache holds every node (``tokens`` lists them in order):
        call :meth:`accept_path` with the chosen branch, or :meth:`truncate` to drop all.
        """
        tokens, parents = list(tokens), list(parents)
        if len(tokens) != len(parents) or not tokens:
            raise ValueError("evaluate_tree needs one parent per token and at least one token")
        check_room(len(self._tokens), len(tokens), self._n_ctx)
        n_past = len(self._tokens)
        wanted = list(range(len(tokens))) if logits_for is None else list(logits_for)
        positions = torch.tensor([n_past + d for d in tree_depths(parents)], device=self.device)
        mask = tree_mask(parents).to(self.device)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self._forward(self.model.embed(ids), positions, mask, wanted)
        self._tokens.extend(tokens)
        self._tree = (n_past, parents)
        return logits

    def accept_path(self, path: Sequence[int]) -> None:
        """Keep only the tree nodes ``path`` (a root-to-node chain of node indices).

        Called after :meth:`evaluate_tree`; the cache then holds prefix + that branch,
        exactly as if the branch had been evaluated as a plain sequence.
        """
        if self._tree is None:
            raise ValueError("accept_path follows evaluate_tree")
        prefix, parents = self._tree
        path = list(path)
        for depth, node in enumerate(path):
            if parents[node] != (path[depth - 1] if depth else -1):
                raise ValueError(f"tree path {path} is not a root-to-node chain")
        self.cache.keep([prefix + i for i in path])
        self._tokens = self._tokens[:prefix] + [self._tokens[prefix + i] for i in path]
        self._tree = None

    def truncate(self, n: int) -> None:
        n = max(0, n)
        self._tree = None
        if n < len(self._tokens):
            self.cache.trim(n)
            del self._tokens[n:]

    def memory(self) -> MemoryReport:
        return MemoryReport(
            weights=self.model.weight_bytes(),
            kv_cache=self.cache.nbytes(),
            scratch=self.n_vocab * self.config.n_batch * 4,
            device=str(self.device),
        )

    def token_embeddings(self) -> np.ndarray:
        """The input embedding matrix (n_vocab, n_embd) as float32 numpy."""
        return self.model.tok_embd.detach().float().cpu().numpy()

    def compute_settings(self) -> ComputeSettings:
        return ComputeSettings(self.path, speed_settings(self.config, self.config.n_threads), self.config.n_threads)

    def set_threads(self, n: int) -> bool:
        """The thread count is fixed when the model is opened."""
        return False

    def close(self) -> None:
        self.cache.reset()
        self._tokens = []
        self.tokenizer.close()

    def __enter__(self) -> TorchBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------
    def _chunked(self, x: torch.Tensor, tokens: list[int], logits_for: Sequence[int] | None) -> np.ndarray:
        n = x.shape[0]
        check_room(len(self._tokens), n, self._n_ctx)

        def run(start: int, stop: int, rows: list[int]) -> np.ndarray:
            n_past = len(self._tokens)
            positions = torch.arange(n_past, n_past + stop - start, device=self.device)
            logits = self._forward(x[start:stop], positions, None, rows)
            self._tokens.extend(tokens[start:stop])
            return logits

        return chunked_logits(n, self.config.n_batch, self.n_vocab, logits_for, run)

    def _forward(
        self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, rows: list[int]
    ) -> np.ndarray:
        """One pass over new entries; commits them to the cache; float32 logits for ``rows``."""
        self._tree = None
        if not rows:  # still run the layers so the cache fills, skip the output head
            rows_t = torch.zeros(0, dtype=torch.long, device=self.device)
        else:
            rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        try:
            logits = self.model(x, positions, self.cache, mask, rows_t)
        except Exception:
            self.cache.trim(len(self._tokens))
            raise
        self.cache.commit(x.shape[0])
        return logits.float().cpu().numpy()
