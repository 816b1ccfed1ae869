"""Speculative decoding as a :mod:`tandem.runtime.generate` strategy, and its factory.

One round: the drafter proposes up to k tokens, the target verifies them in **one**
``evaluate`` over ``[last committed token] + draft`` asking logits for every row, the
acceptance kernel (:mod:`tandem.kernels.acceptance`) keeps a prefix and emits one
token, and both KV caches are rolled back to the committed sequence.

Invariant between rounds: the target cache holds every committed token but the last,
whose logits the next round's verify call produces anyway. That makes plain decoding
(k = 0) the same one-token call as :func:`~tandem.runtime.generate.autoregressive`, and
a round with k drafted tokens one call over k+1 tokens (the c(k) of
:mod:`tandem.runtime.speculative.policy`).

Callers (CLI, TUI, server) build a strategy with :func:`build_strategy` and pass it to
``generate(..., strategy=...)``; see its docstring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.kernels.acceptance import Verdict, verify_greedy, verify_sampled
from tandem.kernels.sampling import Sampler
from tandem.models.errors import TandemError
from tandem.runtime.backends.protocol import Backend, common_prefix_len
from tandem.runtime.generate import Commit, DecodeStats, autoregressive
from tandem.runtime.speculative.drafters.base import Draft, Drafter
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.policy import (
    AdaptiveConfig,
    AdaptivePolicy,
    FixedLength,
    LengthPolicy,
    OnlineCost,
    cached_cost_curve,
)

RoundHook = Callable[[Backend, Drafter, list[int]], None]
"""Called after every round with (target, drafter, committed context): a test hook."""

MODES = ("auto", "model", "xvocab", "ngram", "off")
MODEL_FREE_SOURCES = frozenset({"suffix", "lookup"})
"""Draft sources that cost nothing to ask (see AdaptivePolicy.cheap_sources)."""


def _prefill_all_but_last(target: Backend, prompt: Sequence[int]) -> None:
    """Cache ``prompt[:-1]`` (reusing the cached prefix); the last token goes with round 1."""
    reuse = common_prefix_len(target.tokens, prompt[:-1])
    target.truncate(reuse)
    if len(prompt) - 1 > reuse:
        target.evaluate(list(prompt[reuse:-1]))


def _history(context: list[int], draft: Sequence[int], i: int, sampler: Sampler) -> Sequence[int]:
    """What the sampler sees before position ``i`` (only the penalty reads it)."""
    if sampler.params.repetition_penalty == 1.0:
        return ()
    return context + list(draft[:i])


def _align_q(q: np.ndarray | None, n_vocab: int) -> np.ndarray | None:
    """Pad a drafter's q to the target vocabulary (extra target ids get q = 0)."""
    if q is None or q.shape[1] == n_vocab:
        return q
    if q.shape[1] > n_vocab:
        if np.any(q[:, n_vocab:] > 0):
            raise TandemError("The drafter proposes token ids the target does not have.")
        return q[:, :n_vocab]
    return np.pad(q, ((0, 0), (0, n_vocab - q.shape[1])))


def draft_sources(drafter: Drafter) -> list[Drafter]:
    """The drafters a chain asks in turn (nested chains flattened), or just ``drafter``."""
    if isinstance(drafter, ChainDrafter):
        return [d for inner in drafter.drafters for d in draft_sources(inner)]
    return [drafter]


def draft_round(sources: Sequence[Drafter], policy: LengthPolicy, context: list[int], k: int,
                sampler: Sampler) -> Draft:
    """This round's draft: ask the sources in order (model-free ones first) for what the
    policy allots each out of ``k`` (its :meth:`~LengthPolicy.next_length`, capped by the
    room left), and take the first draft the policy keeps any of (it may keep a prefix).
    An empty draft makes a plain round."""
    for source in sources:
        n = policy.length_for(source.name, k)
        if n <= 0:
            continue
        draft = source.propose(context, n, sampler)
        if draft.tokens:
            keep = policy.trim(draft.confidence, len(draft.tokens), draft.source or source.name)
            if keep:
                return _cut(draft, keep)
    return Draft([], None, "")


def verify_round(
    logits: np.ndarray, draft: Draft, context: list[int], sampler: Sampler, n_vocab: int
) -> Verdict:
    """Target logits rows (``len(draft)+1``) + the draft -> accepted count and next token."""
    tokens = draft.tokens
    if sampler.greedy or sampler.keyed:
        # Seeded sampling draws each position's token as plain decoding would (keyed by
        # position) and accepts while the draft agrees: the text repeats whatever drafting does.
        choices: list[int] = []
        for i in range(len(tokens) + 1):  # lazily, up to the first mismatch
            choices.append(sampler.sample_at(logits[i], len(context) + i, _history(context, tokens, i, sampler)))
            if i < len(tokens) and choices[i] != tokens[i]:
                break
        return verify_greedy(tokens, choices)
    p = np.stack([sampler.distribution(logits[i], _history(context, tokens, i, sampler)) for i in range(len(tokens) + 1)])
    return verify_sampled(tokens, p, _align_q(draft.q, n_vocab), sampler.rng)


def verify_logits(target: Backend, context: list[int], draft: Draft, sampler: Sampler) -> np.ndarray:
    """Target logits for ``[context[-1], *draft]``, one row per position, as one call —
    or, when the target computes long batches differently from one-token steps, as calls
    of at most ``target.exact_batch`` tokens, stopping (greedy) at the chunk where the
    target first disagrees with the draft: rows past that point would never be read."""
    feed = [context[-1], *draft.tokens]
    step = target.exact_batch or len(feed)
    rows: list[np.ndarray] = []
    for start in range(0, len(feed), step):
        chunk = feed[start:start + step]
        logits = target.evaluate(chunk, logits_for=range(len(chunk)))
        rows.append(logits)
        if sampler.greedy and start + len(chunk) < len(feed):
            ahead = feed[start + 1:start + len(chunk) + 1]  # the draft tokens these rows predict
            if any(sampler(logits[i], _history(context, draft.tokens, start + i, sampler)) != t
                   for i, t in enumerate(ahead)):
                break
    return rows[0] if len(rows) == 1 else np.concatenate(rows)


def _cut(draft: Draft, n: int) -> Draft:
    """The first ``n`` tokens of a draft, with their q rows and confidences."""
    if len(draft.tokens) <= n:
        return draft
    return Draft(draft.tokens[:n], None if draft.q is None else draft.q[:n], draft.source,
                 None if draft.confidence is None else draft.confidence[:n])


def _predraft(drafter: Drafter, assumed: list[int], k: int, sampler: Sampler) -> tuple[list[int], Draft]:
    """Draft a guess of the bonus token plus ``k`` after ``assumed`` (all drafts accepted);
    return (the context that draft presumes, the draft after the guess)."""
    d = drafter.propose(assumed, k + 1, sampler)
    if not d.tokens:
        return assumed, d
    rest = Draft(d.tokens[1:], None if d.q is None else d.q[1:], d.source,
                 None if d.confidence is None else d.confidence[1:])
    return [*assumed, d.tokens[0]], rest


def speculative(drafter: Drafter, policy: LengthPolicy, *, hook: RoundHook | None = None, predraft: bool = False):
    """A strategy drafting with ``drafter``, draft lengths from ``policy``.

    ``predraft`` (PEARL-style): while the target verifies a round, a background thread
    already drafts the next one, assuming every draft is accepted and guessing the bonus
    token; the next round uses it when that guess came true and drops it otherwise. It
    pays when drafter and target run on different devices (drafter on a GPU, target on
    CPU threads), and only where the acceptance outlook allows: each round asks
    ``policy.predraft_pays(n)``. The output is the same either way.
    """

    def strategy(target: Backend, prompt: list[int], sampler: Sampler, stats: DecodeStats) -> Iterator[Commit]:
        context = list(prompt)
        sources = draft_sources(drafter)
        _prefill_all_but_last(target, context)
        if hasattr(drafter, "stop_threshold"):
            drafter.stop_threshold = policy.stop_threshold
        calls0 = int(getattr(drafter, "calls", 0))
        extra = stats.extra
        for key in ("draft_s", "verify_s", "round_s", "rounds_speculative", "predraft_hits", "predraft_misses"):
            extra.setdefault(key, 0.0)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-predraft") if predraft else None
        pending: Future | None = None
        caught_up = False
        owed: tuple[list[int], int] | None = None
        """A round whose ``drafter.commit`` waits until the background draft is done."""
        try:
            while len(context) <= target.n_ctx:
                start = time.perf_counter()
                k = min(policy.next_length(), target.n_ctx - len(context))
                draft = None
                if pending is not None:
                    assumed, ready = pending.result()
                    pending = None
                    if owed is not None:
                        drafter.commit(*owed)
                        owed = None
                    if assumed == context and ready.tokens and k > 0:
                        draft = _cut(ready, k)
                        extra["predraft_hits"] += 1
                    else:
                        extra["predraft_misses"] += 1
                if draft is None:
                    draft = draft_round(sources, policy, context, k, sampler)
                source = draft.source or drafter.name
                drafted_at = time.perf_counter()
                n = len(draft.tokens)
                room = target.n_ctx - len(context) - n - 1
                if pool is not None and n and room > 0 and policy.predraft_pays(n):
                    pending = pool.submit(_predraft, drafter, [*context, *draft.tokens], min(k, room), sampler)
                logits = verify_logits(target, context, draft, sampler)
                verified_at = time.perf_counter()
                verdict = verify_round(logits, _cut(draft, len(logits) - 1), context, sampler, target.n_vocab)
                accepted = draft.tokens[: verdict.accepted]
                target.truncate(len(context) + verdict.accepted)
                context.extend(accepted)
                context.append(verdict.token)
                if pending is not None and verdict.accepted < n:
                    pending.result()  # presumed drafts that were rejected: unusable
                    pending = None
                    extra["predraft_misses"] += 1
                if pending is None:
                    drafter.commit(context, verdict.accepted)  # also on k = 0: caches stay in sync
                else:
                    owed = (list(context), verdict.accepted)
                end = time.perf_counter()
                stats.target_calls += 1
                stats.rounds += 1
                stats.drafted_tokens += n
                stats.accepted_tokens += verdict.accepted
                stats.draft_calls = int(getattr(drafter, "calls", 0)) - calls0
                extra["draft_s"] += drafted_at - start
                extra["verify_s"] += verified_at - drafted_at
                extra["round_s"] += end - start
                if n:
                    extra["rounds_speculative"] += 1
                    extra[f"drafted:{source}"] = extra.get(f"drafted:{source}", 0.0) + n
                    extra[f"accepted:{source}"] = extra.get(f"accepted:{source}", 0.0) + verdict.accepted
                policy.observe(n, verdict.accepted, drafted_at - start - draft.catch_up_s, verified_at - drafted_at,
                               end - start - draft.catch_up_s, source,
                               timed=caught_up or n == 0, evaluated=len(logits))
                caught_up = caught_up or n > 0  # the first drafting round also paid the catch-up
                if hook is not None and pending is None:
                    hook(target, drafter, context)
                yield Commit([*accepted, verdict.token], verdict.accepted, logits[: verdict.accepted + 1])
        finally:
            if pending is not None:
                pending.result()
            if owed is not None:
                drafter.commit(*owed)
            if pool is not None:
                pool.shutdown(wait=True)

    return strategy


@dataclass
class SpecOptions:
    """How :func:`build_strategy` sets speculation up."""

    mode: str = "auto"
    """auto | model | xvocab | ngram | off (see :func:`build_strategy`)."""
    draft_max: int = 8
    """Upper bound on tokens drafted per round."""
    draft_length: int | None = None
    """A fixed draft length (no adaptation); ``None`` = adaptive."""
    stop_threshold: float | None = 0.8
    """SpecDec++ threshold for model drafters (adaptive mode only)."""
    measure_cost: bool = True
    """Start from the c(k) measured for this target on this machine (``tandem bench``
    caches it; CPU time, minimum of repetitions), else from a generic CPU curve.
    Either way the curve is learnt online from the run's own verify calls, and nothing
    is measured before the first token. What a run learns is not saved: wall-clock
    verify times next to a drafter's spinning threads run high, and a saved curve
    would feed that back into the next run's prior."""
    draft_window: int | None = None
    """Cap on the draft model's context (the memory planner's ``plan.draft.window``): it
    then drafts from a sliding window of the latest tokens instead of stopping."""
    draft_device: str = "cpu"
    """``cuda``: open a drafter given as a path in the torch engine on the GPU (the
    planner's ``plan.draft.device``); ``cpu``: the backend its file type implies."""
    predraft: bool | None = None
    """Draft the next round while the target verifies (see :func:`speculative`);
    ``None``: on when the drafter runs on its own device (``draft_device="cuda"``)."""
    draft_cost: float | None = None
    """Measured drafter seconds per token over the target's one-token call (from the
    placement calibration): the adaptive policy starts from it instead of learning it."""
    shared_suffix_cache: bool = True
    """Let the suffix-tree drafter learn from every earlier request in the process. The
    server turns it off: what drafts well (and so how fast a reply comes, and its
    drafting statistics) would otherwise reveal other clients' text."""


class SpeculativeStrategy:
    """A ready strategy plus what it owns: call it like any strategy, ``close()`` it.

    ``describe()`` says which drafter and policy are in use (for ``--json`` and the UI);
    ``drafter`` is ``None`` in plain mode.
    """

    def __init__(self, drafter: Drafter | None, policy: LengthPolicy | None, hook: RoundHook | None = None,
                 *, predraft: bool = False) -> None:
        self.drafter = drafter
        self.policy = policy
        self.predraft = predraft
        self._run = (speculative(drafter, policy, hook=hook, predraft=predraft)
                     if drafter is not None and policy is not None else None)

    def __call__(self, target: Backend, prompt: list[int], sampler: Sampler, stats: DecodeStats) -> Iterator[Commit]:
        if self._run is None:
            return autoregressive(target, prompt, sampler, stats)
        return self._run(target, prompt, sampler, stats)

    def describe(self) -> dict:
        if self.drafter is None:
            return {"drafter": None, "policy": "off"}
        policy = self.policy
        info: dict = {"drafter": self.drafter.name, "policy": type(policy).__name__, "predraft": self.predraft}
        backends = [getattr(getattr(d, "inner", d), "backend", None) for d in getattr(self.drafter, "drafters", [self.drafter])]
        devices = [b.memory().device for b in backends if b is not None]
        if devices:
            info["drafter_device"] = devices[0]
        if isinstance(policy, FixedLength):
            info["draft_length"] = policy.k
        elif isinstance(policy, AdaptivePolicy):
            info["cost_curve"] = [round(c, 3) for c in policy.cost.c]
            info["rounds_off"] = policy.rounds_off
        return info

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
            self._run = None


# Cost curve assumed when measuring is switched off: the 2-core CPU figures of issue 3.
CPU_COST_CURVE = (1.0, 1.7, 1.9, 2.1, 2.4, 2.55, 2.7, 2.85, 3.0)


def model_free_drafter(target: Backend, *, shared: bool = True) -> Drafter:
    """Suffix-tree drafting (with the in-process global tree for this vocabulary unless
    ``shared`` is off) ahead of prompt lookup."""
    from tandem.runtime.speculative.drafters.lookup import PromptLookupDrafter
    from tandem.runtime.speculative.drafters.suffix import SuffixDrafter, global_cache

    suffix = SuffixDrafter(global_cache=global_cache(f"{target.name}:{target.n_vocab}") if shared else None)
    return ChainDrafter([suffix, PromptLookupDrafter()])


def open_model_drafter(target: Backend, draft: str | Path | Backend, mode: str, *, llama_config=None,
                       device: str = "cpu", torch_config=None) -> Drafter:
    """A model drafter for ``draft`` (a GGUF path, a store name or an open backend):
    same-vocabulary when the vocabularies match, cross-vocabulary otherwise (``auto``),
    or as ``mode`` demands."""
    from tandem.runtime.speculative.drafters.model import ModelDrafter, same_vocabulary

    owns = not isinstance(draft, Backend)
    if owns:
        from tandem.models.store import resolve_model
        from tandem.runtime.backends.opener import open_backend

        path = resolve_model(str(draft))
        if device == "cuda":
            from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig

            backend = TorchBackend(path, torch_config or TorchConfig(device="cuda", n_ctx=target.n_ctx + 16))
            backend.evaluate([backend.special.bos or 0])  # first CUDA launches (kernels, cuBLAS) are slow:
            backend.truncate(0)  # pay them here, not in the first round the adaptive policy times
        else:
            backend = open_backend(path, n_ctx=target.n_ctx, llama_config=llama_config)
    else:
        backend = draft
    try:
        same = same_vocabulary(target, backend)
        if mode == "model" and not same:
            raise TandemError(
                f"The drafter {backend.name} has a different vocabulary from {target.name}: "
                "use --draft-mode xvocab (or auto)."
            )
        if mode == "model" or (mode == "auto" and same):
            return ModelDrafter(backend, owns_backend=owns)
        from tandem.runtime.speculative.drafters.xvocab.drafter import CrossVocabDrafter

        return CrossVocabDrafter(backend, target, owns_backend=owns)
    except BaseException:
        if owns:
            backend.close()
        raise


def build_strategy(
    target: Backend,
    draft: str | Path | Backend | None = None,
    options: SpecOptions | None = None,
    *,
    llama_config=None,
    torch_config=None,
    hook: RoundHook | None = None,
) -> SpeculativeStrategy:
    """THE entry point for speculative decoding (CLI, TUI, server and bench call it).

    ``draft``: a drafter model (GGUF path, store name, or an open :class:`Backend`), or
    ``None`` for model-free drafting only. ``options.mode``:

    * ``auto`` (default): model-free drafters (suffix tree, prompt lookup) first, then
      the model drafter if one is given (same-vocab if the vocabularies match, else
      cross-vocab); adaptive length, switched off when it does not pay;
    * ``model`` / ``xvocab``: only that model drafter (``draft`` required);
    * ``ngram``: only the model-free drafters;
    * ``off``: plain decoding (exactly :func:`autoregressive`).

    Adaptive policies learn the target's verify-cost curve online (starting from a
    measured curve cached for this model and machine, when there is one). Draft-model backends opened here use
    ``llama_config`` (default: the target's context size), or ``torch_config`` for a
    drafter on the GPU (the planner's priced config). Close the result when done
    (it frees the drafter); the target stays open. Output is lossless in every mode.
    """
    from tandem.runtime.speculative.policy import CostCurve

    opts = options or SpecOptions()
    if opts.mode not in MODES:
        raise TandemError(f"Unknown draft mode {opts.mode!r}; choose one of {', '.join(MODES)}.")
    if opts.mode == "off":
        return SpeculativeStrategy(None, None)
    if opts.mode in ("model", "xvocab") and draft is None:
        raise TandemError(f"--draft-mode {opts.mode} needs a drafter model (--draft).")
    if opts.draft_max < 1 or (opts.draft_length is not None and opts.draft_length < 0):
        raise TandemError("The draft length must be positive.")
    drafters: list[Drafter] = []
    if opts.mode in ("auto", "ngram"):
        drafters.append(model_free_drafter(target, shared=opts.shared_suffix_cache))
    if draft is not None and opts.mode != "ngram":
        model_drafter = open_model_drafter(target, draft, opts.mode, llama_config=llama_config,
                                           device=opts.draft_device, torch_config=torch_config)
        if opts.draft_window:
            from tandem.runtime.speculative.overlap import WindowedDrafter

            model_drafter = WindowedDrafter(model_drafter, opts.draft_window)
        drafters.append(model_drafter)
    drafter = drafters[0] if len(drafters) == 1 else ChainDrafter(drafters)
    policy: LengthPolicy
    if opts.draft_length is not None:
        policy = FixedLength(opts.draft_length)
    else:
        k_max = opts.draft_max
        cached = cached_cost_curve(target, k_max) if opts.measure_cost else None
        cost = OnlineCost(cached or CostCurve(CPU_COST_CURVE, 0.0), chunk=target.exact_batch)
        model_free = draft is None or opts.mode == "ngram"
        policy = AdaptivePolicy(cost, AdaptiveConfig(max_len=k_max, stop_threshold=opts.stop_threshold),
                                draft_cost=opts.draft_cost or 0.0,
                                cheap_drafter=model_free,
                                cheap_sources=frozenset() if model_free or len(drafters) == 1 else MODEL_FREE_SOURCES)
    predraft = opts.predraft if opts.predraft is not None else opts.draft_device == "cuda"
    return SpeculativeStrategy(drafter, policy, hook, predraft=predraft)
