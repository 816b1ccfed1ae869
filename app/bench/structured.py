"""`tandem bench --structured`: schema-constrained extraction, the replies agents ask for.

Each prompt gives a short text and asks for a record of a JSON schema with many fields
and short values (a schema-heavy reply: most of its tokens are braces, quotes, keys and
separators). Configurations, run back to back on the same prompt, greedy:

* ``plain``: plain constrained decoding (every step one target call; the baseline);
* ``forced``: forced runs committed without a target call (no drafter);
* ``lookup+forced``: model-free speculation only (prompt lookup and suffix tree, adaptive
  length) with forced runs: an extraction copies its values from the prompt, and these
  drafts cost no model;
* ``spec+forced``: speculation (``auto``: model-free drafting, and the drafter model when
  ``--draft`` names one, adaptive length) with forced runs;
* ``llama-grammar``: llama-cpp-python's own grammar decoding, ``LlamaGrammar`` converted
  from the same schema, on the same model file, threads and context.

Tandem's three must give the same tokens (checked and reported); llama.cpp's grammar
lays JSON out its own way, so its reply differs and only its rate compares. A rate is the
reply's tokens over the whole call's time (the prompt is read into the cache, untimed,
before a prompt's runs, so that is decoding time: a decode rate after the first token would count a forced run that
comes with the first token as free), and each is also reported as a ratio to the
``plain`` run of the same prompt and repetition.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.app.bench.alternating import plain_runs, rotated_runs, same_as_plain, vs_plain
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.chat import chat_prompt
from tandem.runtime.constrained import GrammarSpec, compile_grammar
from tandem.runtime.constrained.strategy import constrained
from tandem.runtime.engine.builder import open_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.generate import DoneEvent, autoregressive, generate

CONFIGS = ("plain", "forced", "lookup+forced", "spec+forced", "llama-grammar")

_PERSON = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string"}, "last_name": {"type": "string"},
        "age": {"type": "integer"}, "city": {"type": "string"}, "country": {"type": "string"},
        "occupation": {"type": "string"}, "employer": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "is_remote": {"type": "boolean"},
    },
    "required": ["first_name", "last_name", "age", "city", "country", "occupation", "employer", "languages",
                 "is_remote"],
    "additionalProperties": False,
}
_ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"}, "customer_name": {"type": "string"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"product": {"type": "string"}, "quantity": {"type": "integer"},
                           "unit_price": {"type": "number"}},
            "required": ["product", "quantity", "unit_price"], "additionalProperties": False}},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "express_delivery": {"type": "boolean"},
    },
    "required": ["order_id", "customer_name", "status", "items", "currency", "express_delivery"],
    "additionalProperties": False,
}
_EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string"}, "date": {"type": "string"}, "start_time": {"type": "string"},
        "end_time": {"type": "string"}, "location": {"type": "string"},
        "organizer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                      "required": ["name", "email"], "additionalProperties": False},
        "capacity": {"type": "integer"}, "is_public": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["title", "date", "start_time", "end_time", "location", "organizer", "capacity", "is_public", "tags"],
    "additionalProperties": False,
}

PROMPTS: tuple[tuple[str, dict], ...] = (
    ("Extract the person's record as JSON: Priya Raman, 41, lives in Lyon, France. She is a data engineer at "
     "Voltaire Analytics, works fully remotely and speaks English, French and Tamil.", _PERSON),
    ("Extract the order as JSON: order A-20931 from Jonas Berg was shipped yesterday. It holds 2 mechanical "
     "keyboards at 89.50 EUR each and 1 USB hub at 24.00 EUR. No express delivery.", _ORDER),
    ("Extract the event as JSON: the Rust Meetup Berlin is on 2025-03-14 from 18:30 to 21:00 at c-base, "
     "organized by Anna Vogel (anna@rustberlin.org). 80 seats, open to everyone; topics: async, embedded.", _EVENT),
)


@dataclass
class StructuredRun:
    config: str
    prompt: int
    rep: int
    tokens: list[int]
    text: str
    tokens_per_s: float
    """The reply's tokens over the call's seconds."""
    target_calls: int
    forced_tokens: int = 0
    accepted: int = 0
    drafted: int = 0


@dataclass
class StructuredConfig:
    target: Path
    draft: Path | None = None
    threads: int = 2
    ctx: int = 1024
    max_tokens: int = 256
    prompts: int = len(PROMPTS)
    reps: int = 2
    configs: Sequence[str] = CONFIGS
    log: Callable[[str], None] = print
    notes: list[str] = field(default_factory=list)


def _tandem_run(target: Backend, prompt: list[int], strategy, max_tokens: int) -> DoneEvent:
    done = list(generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                         max_tokens=max_tokens))[-1]
    assert isinstance(done, DoneEvent)
    return done


class LlamaGrammarPeer:
    """llama-cpp-python's grammar decoding (``LlamaGrammar.from_json_schema``), greedy."""

    def __init__(self, path: Path, *, n_ctx: int, threads: int) -> None:
        import llama_cpp  # local: llama.cpp's libraries load only when this runs

        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def run(self, prompt: list[int], schema: dict, max_tokens: int) -> tuple[list[int], str, float]:
        from llama_cpp import LlamaGrammar  # local: llama.cpp's libraries load only when this runs

        grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        out: list[int] = []
        start = time.perf_counter()
        eog = {self.llm.token_eos()}
        gen = self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True,
                                grammar=grammar)
        try:
            for tok in gen:
                if int(tok) in eog or llama_is_eog(self.llm, int(tok)):
                    break
                out.append(int(tok))
                if len(out) >= max_tokens:
                    break
        finally:
            gen.close()
        seconds = time.perf_counter() - start
        text = self.llm.detokenize(out).decode("utf-8", errors="replace")
        return out, text, len(out) / seconds

    def close(self) -> None:
        self.llm.close()


def llama_is_eog(llm, token: int) -> bool:
    import llama_cpp  # local: llama.cpp's libraries load only when this runs

    return bool(llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token))


def run_structured(cfg: StructuredConfig) -> dict:
    """Every configuration on every prompt, alternating (rotated per prompt and
    repetition), and the summary: median rates, ratios to ``plain``, identity."""
    # Opened as `tandem serve` opens it (planned, placed, this machine's kernels): the
    # configurations differ only in the strategy run on the one target.
    engine = open_engine(EngineSpec(cfg.target, drafter=cfg.draft, draft_mode="auto", threads=cfg.threads,
                                    n_ctx=cfg.ctx, suffix_memory="request"))
    target = engine.target
    peer = (LlamaGrammarPeer(cfg.target, n_ctx=cfg.ctx, threads=cfg.threads)
            if "llama-grammar" in cfg.configs else None)
    strategy = engine.strategy
    lookup = engine.fresh_strategy(mode="ngram")
    load_start = list(os.getloadavg())
    try:
        work = []
        for text, schema in PROMPTS[: cfg.prompts]:
            ids = chat_prompt(target, [{"role": "user", "content": text}])[0]
            work.append((ids, schema, compile_grammar(GrammarSpec("json_schema", schema), target)))

        def one(name: str, pi: int, rep: int, max_tokens: int) -> StructuredRun:
            ids, schema, grammar = work[pi]
            if name == "llama-grammar":
                assert peer is not None
                tokens, text, rate = peer.run(ids, schema, max_tokens)
                return StructuredRun(name, pi, rep, tokens, text, rate, len(tokens))
            inner = {"plain": autoregressive, "forced": autoregressive, "lookup+forced": lookup,
                     "spec+forced": strategy}[name]
            done = _tandem_run(target, ids, constrained(inner, grammar, forced_rounds=name != "plain"), max_tokens)
            s = done.stats
            return StructuredRun(name, pi, rep, done.tokens, done.text, len(done.tokens) / s.total_s, s.target_calls,
                                 s.forced_tokens, s.accepted_tokens, s.drafted_tokens)

        # one reader per engine: Tandem's configurations share the target
        readers = sorted({"plain" if n != "llama-grammar" else n for n in cfg.configs})
        runs = rotated_runs(cfg.configs, len(work), cfg.reps, cfg.max_tokens, one, readers, lambda run: cfg.log(
            f"rep {run.rep} p{run.prompt} {run.config:14s} {run.tokens_per_s:7.2f} tok/s  {len(run.tokens):4d} tokens "
            f"calls {run.target_calls:4d} forced {run.forced_tokens:3d} acc {run.accepted}/{run.drafted}"))
    finally:
        lookup.close()
        if peer is not None:
            peer.close()
        engine.close()
    return summarize(runs, cfg, load_start)


def summarize(runs: list[StructuredRun], cfg: StructuredConfig, load_start: list[float]) -> dict:
    plain = plain_runs(runs)
    rows = {}
    for name in cfg.configs:
        mine = [r for r in runs if r.config == name]
        if not mine:
            continue
        rows[name] = {
            "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
            "vs_plain": vs_plain(mine, plain),
            "tokens": statistics.median(len(r.tokens) for r in mine),
            "target_calls": statistics.median(r.target_calls for r in mine),
            "forced_tokens": statistics.median(r.forced_tokens for r in mine),
            "identical_to_plain": same_as_plain(mine, plain) if name != "llama-grammar" else None,
            "valid_json": all(_is_json(r.text) for r in mine),
        }
    return {"target": str(cfg.target), "draft": str(cfg.draft) if cfg.draft else None, "threads": cfg.threads,
            "prompts": len({r.prompt for r in runs}), "reps": cfg.reps, "max_tokens": cfg.max_tokens,
            "load_start": load_start, "load_end": list(os.getloadavg()), "configs": rows,
            "runs": [r.__dict__ for r in runs]}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def markdown_table(report: dict) -> str:
    lines = ["| configuration | tok/s (median) | vs plain constrained (median, min-max) | tokens | target calls | "
             "forced tokens | same tokens as plain | valid JSON |", "|---|---|---|---|---|---|---|---|"]
    for name, row in report["configs"].items():
        ratio = row["vs_plain"]
        vs = f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "-"
        same = {True: "yes", False: "NO", None: "n/a (own layout)"}[row["identical_to_plain"]]
        lines.append(f"| {name} | {row['tokens_per_s']:.2f} | {vs} | {row['tokens']:.0f} | {row['target_calls']:.0f} | "
                     f"{row['forced_tokens']:.0f} | {same} | {'yes' if row['valid_json'] else 'NO'} |")
    return "\n".join(lines)
