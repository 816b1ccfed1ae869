"""Build a speculative strategy: which drafters, which length policy, what it owns.

:func:`build_strategy` is the one place where a draft mode (auto, model, xvocab, ngram,
off) becomes drafters plus a policy around :func:`~tandem.runtime.speculative.loop.speculative`;
the engine builder (:mod:`tandem.runtime.engine.builder`) calls it for every front end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.models.paths import data_dir
from tandem.runtime.backends.deferred import DeferredBackend
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.choices import MODES, SuffixMemory
from tandem.runtime.generate import Commit, DecodeStats, autoregressive
from tandem.runtime.speculative.cost import CPU_COST_CURVE, OnlineCost, one_token_step_s
from tandem.runtime.speculative.cost_cache import (
    DrafterCosts,
    cached_cost_curve,
    cached_drafter_costs,
    remember_cost_curve,
    remember_drafter_costs,
    times_drafter_call,
)
from tandem.runtime.speculative.drafter_model import open_model_drafter
from tandem.runtime.speculative.drafters.base import Drafter
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.drafters.lookup import PromptLookupDrafter
from tandem.runtime.speculative.drafters.prediction import Prediction, PredictionDrafter
from tandem.runtime.speculative.drafters.suffix import SuffixDrafter, global_cache
from tandem.runtime.speculative.drafters.xvocab.translation_cache import vocab_fingerprint
from tandem.runtime.speculative.loop import RoundHook, speculative
from tandem.runtime.speculative.overlap import WindowedDrafter
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy
from tandem.runtime.speculative.policy.adaptive_config import AdaptiveConfig
from tandem.runtime.speculative.policy.base import FixedLength, LengthPolicy

MODEL_FREE_SOURCES = frozenset({"suffix", "lookup", "text-lookup", "prediction"})
"""Draft sources that cost nothing to ask (see AdaptivePolicy.cheap_sources)."""
MEASURED_SOURCES = frozenset({"text-lookup", "prediction"})
"""Model-free sources judged by their own verdicts alone, trusted from the start (see
AdaptivePolicy.measured_sources): text lookup's confidence is a measured acceptance rate;
a prediction is the client's word on the reply, and drafts text other than the reply's
repeats (pooled with the suffix tree's and lookup's failures on chat prose, it was never
verified once)."""


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
    """Start the adaptive policy from the c(k) measured for this target on this machine:
    cached (``tandem bench --cost-curve`` measures it thoroughly), or else timed in the
    first decoding rounds (:meth:`~tandem.runtime.speculative.cost.OnlineCost.untimed`:
    three padded verify calls that still emit tokens, nothing before the first token)
    and cached when the strategy closes. ``False``: start from a generic CPU curve.
    Either way the curve is learnt online from the run's own verify calls."""
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
    suffix_memory: SuffixMemory = "process"
    """What the suffix-tree drafter learns from besides the request: every earlier
    request in the process (``process``), and earlier sessions' too (``saved``, kept in
    the user's data dir), or nothing (``request``). The server keeps to ``request``:
    what drafts well (and so how fast a reply comes, and its drafting statistics) would
    otherwise reveal other clients' text."""


class SpeculativeStrategy:
    """A ready strategy plus what it owns: call it like any strategy, ``close()`` it.

    ``describe()`` says which drafter and policy are in use (for ``--json`` and the UI);
    ``drafter`` is ``None`` in plain mode.
    """

    def __init__(self, drafter: Drafter | None, policy: LengthPolicy | None, hook: RoundHook | None = None,
                 *, predraft: bool = False, on_close: Callable[[], None] | None = None, owns: bool = True) -> None:
        self.drafter = drafter
        self.policy = policy
        self.predraft = predraft
        self.owns = owns
        """``close()`` closes the drafter; ``False`` for one request's strategy around a
        longer-lived one's drafter (:meth:`predicting`)."""
        self._on_close = on_close
        """Saves what the policy learnt for the next strategy (:func:`build_strategy`)."""
        self._run = (speculative(drafter, policy, hook=hook, predraft=predraft)
                     if drafter is not None and policy is not None else None)

    def __call__(self, target: Backend, prompt: list[int], sampler: Sampler, stats: DecodeStats,
                 budget: int | None = None) -> Iterator[Commit]:
        if self._run is None:
            return autoregressive(target, prompt, sampler, stats, budget)
        return self._run(target, prompt, sampler, stats, budget)

    def describe(self) -> dict:
        if self.drafter is None:
            return {"drafter": None, "policy": "off"}
        policy = self.policy
        info: dict = {"drafter": self.drafter.name, "policy": type(policy).__name__, "predraft": self.predraft}
        backend = self.drafter.model_backend()
        if backend is not None:
            info["drafter_device"] = backend.memory().device
        if isinstance(backend, DeferredBackend):  # opened on first need
            info["drafter_loaded"] = backend.is_open
            if backend.failure:
                info["drafter_error"] = backend.failure
        if isinstance(policy, FixedLength):
            info["draft_length"] = policy.k
        elif isinstance(policy, AdaptivePolicy):
            info["cost_curve"] = [round(c, 3) for c in policy.cost.c]
            info["rounds_off"] = policy.rounds_off
        return info

    def predicting(self, prediction: Prediction, reply_start: int) -> SpeculativeStrategy:
        """This strategy for one reply expected to be mostly ``prediction`` (beginning at
        context length ``reply_start``): drafted from the prediction first, then by this
        strategy's drafters, with the same policy, which learns what each source is worth.
        Plain mode stays plain (its user chose not to speculate). The strategy returned
        owns nothing: closing it leaves this one's drafter open."""
        if self.drafter is None or self.policy is None:
            return self
        predicted = PredictionDrafter(prediction, reply_start)
        self.policy.renew(predicted.name)
        drafter = ChainDrafter([predicted, self.drafter])
        return SpeculativeStrategy(drafter, self.policy, predraft=self.predraft, owns=False)

    def prime(self, tokens: Sequence[int]) -> None:
        """Tokens the next request may repeat (see ``Drafter.prime``); nothing in plain mode."""
        if self.drafter is not None:
            self.drafter.prime(tokens)

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()
        if self.drafter is not None and self.owns:
            self.drafter.close()
        self.drafter = None
        self._run = None




def model_free_drafter(target: Backend, *, memory: SuffixMemory = "process") -> Drafter:
    """Suffix-tree drafting ahead of prompt lookup; the suffix tree learns from what
    ``memory`` says (:data:`~tandem.runtime.choices.SuffixMemory`)."""
    shared = None
    if memory != "request":
        key = sampled_vocab_key(target)
        file = data_dir() / "suffix-tree" / f"{key}.json" if memory == "saved" else None
        shared = global_cache(key, file=file, n_vocab=target.n_vocab)
    return ChainDrafter([SuffixDrafter(global_cache=shared), PromptLookupDrafter()])


def sampled_vocab_key(target: Backend, samples: int = 2048) -> str:
    """A vocabulary's fingerprint from its size and an even sample of its tokens' bytes
    (~2 ms where all 151,936 take 0.2 s): two models share a suffix tree when their
    tokenizers agree on these. A collision could only make drafts that verification
    rejects, never change the output."""
    step = max(1, target.n_vocab // samples)
    return vocab_fingerprint((target.token_bytes(i) for i in range(0, target.n_vocab, step)), extra=str(target.n_vocab))


def weight_ratio(drafter: Drafter, target: Backend) -> float:
    """The drafter's cost per token as a share of the target's, before it is timed: the
    ratio of their weight bytes (a token reads every weight once, whether the matmuls
    are memory- or compute-bound; Qwen 0.5B vs 1.5B on one core: 0.36, measured 0.33).
    0 for model-free drafters."""
    target_weights = target.memory().weights
    return drafter.weight_bytes() / target_weights if target_weights > 0 else 0.0


def drafter_call_cost(model_drafter: Drafter | None, target_step_s: float | None) -> float | None:
    """One call of the drafter's model, timed now, over the target's measured one-token
    step (``None`` without a model, a measured step, or room in the drafter's context)."""
    backend = model_drafter.model_backend() if model_drafter is not None else None
    if backend is None or not target_step_s:
        return None
    step_s = one_token_step_s(backend)
    return None if step_s is None else step_s / target_step_s


def guessed_draft_cost(drafter: Drafter, target: Backend, call_cost: float | None) -> float:
    """The drafter's cost per drafted token before a round has timed it, in target steps:
    its share of the weights (:func:`weight_ratio`), or its model's one-token call
    (:func:`drafter_call_cost`) where that costs more. Every call pays a fixed part beyond
    reading the weights, which a small model's share leaves out: SmolLM2-135M is 0.09 of
    the 1.5B's weights and its step 0.20 of the 1.5B's (2 threads, a Zen 5), so a
    cross-vocabulary pair woke its drafter on the guess, paid its catch-up on the prompt
    and lost 0.7 s of a 2.3 s reply."""
    return max(weight_ratio(drafter, target), call_cost or 0.0)


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
    model_drafter: Drafter | None = None
    if opts.mode in ("auto", "ngram"):
        drafters.append(model_free_drafter(target, memory=opts.suffix_memory))
    if draft is not None and opts.mode != "ngram":
        model_drafter = open_model_drafter(target, draft, opts.mode, llama_config=llama_config,
                                           device=opts.draft_device, torch_config=torch_config)
        if opts.draft_window:
            model_drafter = WindowedDrafter(model_drafter, opts.draft_window)
        drafters.append(model_drafter)
    drafter = drafters[0] if len(drafters) == 1 else ChainDrafter(drafters)
    on_close: Callable[[], None] | None = None
    policy: LengthPolicy
    if opts.draft_length is not None:
        policy = FixedLength(opts.draft_length)
    else:
        k_max = opts.draft_max
        cached = cached_cost_curve(target, k_max) if opts.measure_cost else None
        if cached is not None or not opts.measure_cost:
            cost = OnlineCost(cached or CPU_COST_CURVE, chunk=target.exact_batch)
        else:
            cost = OnlineCost.untimed(k_max, chunk=target.exact_batch)
        model_free = draft is None or opts.mode == "ngram"
        learnt = (cached_drafter_costs(target, model_drafter.name, model_drafter.weight_bytes())
                  if model_drafter is not None and opts.measure_cost else None)
        learnt_draft = learnt.draft_cost if learnt else None
        guessed = not (opts.draft_cost or learnt_draft)
        call_cost = learnt.call_cost if learnt else None
        target_step_s = cached.t1_s if cached else None
        if times_drafter_call(opts.draft_cost, learnt, target_step_s):
            call_cost = drafter_call_cost(model_drafter, target_step_s)
        adaptive = AdaptivePolicy(cost, AdaptiveConfig(max_len=k_max, stop_threshold=opts.stop_threshold),
                                  draft_cost=opts.draft_cost or learnt_draft or guessed_draft_cost(drafter, target, call_cost),
                                  draft_cost_guessed=guessed,
                                  catch_up_cost=learnt.catch_up_cost if learnt else None,
                                  cheap_drafter=model_free, measured_sources=MEASURED_SOURCES,
                                  cheap_sources=frozenset() if model_free else MODEL_FREE_SOURCES)
        if opts.measure_cost:
            on_close = partial(remember_learnt, target, adaptive, model_drafter,
                               draft_cost_known=bool(learnt_draft and not opts.draft_cost), call_cost=call_cost)
        policy = adaptive
    predraft = opts.predraft if opts.predraft is not None else opts.draft_device == "cuda"
    return SpeculativeStrategy(drafter, policy, hook, predraft=predraft, on_close=on_close)


def remember_learnt(target: Backend, policy: AdaptivePolicy, model_drafter: Drafter | None, *,
                    draft_cost_known: bool = False, call_cost: float | None = None) -> None:
    """What a strategy learnt, cached for the next one with this target (and drafter) on
    this machine: the verify-cost curve it measured while decoding, and the model
    drafter's costs that were measured (timed by rounds, or ``draft_cost_known`` from
    before; its model's ``call_cost``), never the guess that stood in for one."""
    if isinstance(policy.cost, OnlineCost) and policy.cost.learnt:
        remember_cost_curve(target, policy.cost.curve(), policy.cost.observed())
    costs = DrafterCosts(policy.draft_cost if policy.draft_timed > 0 or draft_cost_known else None,
                         policy.catch_up_cost, call_cost)
    if model_drafter is not None and costs.known():
        remember_drafter_costs(target, model_drafter.name, model_drafter.weight_bytes(), costs)
