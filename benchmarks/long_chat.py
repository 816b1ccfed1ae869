"""Long chats: what fitting a conversation to the context costs before each reply, and
the time to first token at turn 1, 50 and 200.

Two ways to fit, side by side on one loaded model:

* ``one-at-a-time`` — the reference algorithm: drop the oldest turn, render and tokenize
  the whole chat again, until it fits (cost grows with turns x prompt);
* ``cached`` — :meth:`ChatEngine.fit` (each turn tokenized once for the engine's life;
  the chat app also leaves turns out in runs, so the KV cache of earlier turns stays).

The chat is synthetic (random words, about 152 tokens a turn). The TTFT of turn N puts
in the KV cache what the app would hold after reply N-1 (the part of prompt N that
prompt N-1 shares), then times fit + prefill + the first token. Fitting figures
alternate the two ways, ``--rounds`` times, and report medians with their range.

Run: ``python -m benchmarks.long_chat --model PATH --threads 2``. ``--conversation N``
goes on through the engine as ``tandem chat`` opens it; ``--drafter-index N`` times the
model-free drafters' index alone (no model needed).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.protocol import common_prefix_len
from tandem.runtime.chat import ChatEngine, chat_prompt
from tandem.runtime.generate import TokenEvent, generate

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "programmers",
         "argue", "about", "tabs", "and", "spaces", "in", "a", "small", "office", "near", "the", "river"]


def chat(n: int, seed: int = 0, words: int = 133) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"role": "user" if i % 2 == 0 else "assistant",
             "content": " ".join(rng.choice(WORDS) for _ in range(words))} for i in range(n)]


def one_at_a_time(target, messages, max_tokens: int) -> list[int]:
    msgs = list(messages)
    room = target.n_ctx - max(1, min(max_tokens, target.n_ctx // 2))
    while True:
        ids, _ = chat_prompt(target, msgs)
        if len(ids) <= room:
            return ids
        droppable = [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]
        del msgs[droppable[0]]


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s ({min(xs):.3f}-{max(xs):.3f}, n={len(xs)})"


def fitting(target, rounds: int, max_tokens: int) -> None:
    long = chat(201)
    tiny = [{"role": "user" if i % 2 == 0 else "assistant", "content": "abcdefghijklmnopqrstuvwxyz"[i % 26]}
            for i in range(3000)]
    print(f"201-turn chat: {len(chat_prompt(target, long)[0])} tokens in all; "
          f"3000 messages: {sum(len(m['content']) + 30 for m in tiny) / 1000:.0f} KB of JSON")
    old, warm, cold, many = [], [], [], []
    for _ in range(rounds):
        old.append(timed(lambda: one_at_a_time(target, long, max_tokens)))
        engine = ChatEngine(target)  # a fresh cache: the first request of a server or a chat
        cold.append(timed(lambda e=engine: e.fit(long, max_tokens)))
        engine.fit(long[:199], max_tokens)
        warm.append(timed(lambda e=engine: e.fit(long, max_tokens)))  # the reply after the previous one
        many.append(timed(lambda: ChatEngine(target).fit(tiny, max_tokens)))
    print(f"fit 201 turns, one at a time : {spread(old)}")
    print(f"fit 201 turns, cached (cold) : {spread(cold)}")
    print(f"fit 201 turns, cached (next reply): {spread(warm)}")
    print(f"fit 3000 one-letter messages, cached (cold): {spread(many)}")


def ttft(target, turns: int, max_tokens: int, mode: str, count_only: bool) -> tuple[float, float | None, int, int]:
    """For the reply to a chat of ``turns`` messages (the last one the user's, as in the
    201-turn chat above): seconds fitting takes,
    seconds to the first token (``None`` with ``count_only``), tokens to prefill, prompt
    tokens."""
    msgs = chat(turns)
    engine = ChatEngine(target)
    params = SamplingParams(temperature=0.0)
    if mode == "cached":
        if turns > 1:
            before, _ = engine.fit(msgs[:-2], max_tokens, keep_start=True)
        now, _ = engine.fit(msgs, max_tokens, keep_start=True)
    else:
        before = one_at_a_time(target, msgs[:-2], max_tokens) if turns > 1 else []
        now = one_at_a_time(target, msgs, max_tokens)
    reuse = common_prefix_len(before, now) if turns > 1 else 0
    fit_s = timed(lambda: engine.fit(msgs, max_tokens, keep_start=True) if mode == "cached"
                  else one_at_a_time(target, msgs, max_tokens))
    if count_only:
        return fit_s, None, len(now) - reuse, len(now)
    target.truncate(0)
    if reuse:
        target.evaluate(now[:reuse])  # what the previous reply left in the cache (untimed)
    start = time.perf_counter()
    # The reply's own max_tokens: the room it leaves decides where the chat is cut, so a
    # different one would fit a different prompt than the cache holds.
    if mode == "cached":
        events = engine.stream(msgs, params, max_tokens, keep_start=True)
    else:
        ids = one_at_a_time(target, msgs, max_tokens)
        events = generate(target, ids, Sampler(params), max_tokens=max_tokens)
    for ev in events:
        if isinstance(ev, TokenEvent):
            break
    took = time.perf_counter() - start
    events.close()  # the first token is what is timed: the rest of the reply is not generated
    return fit_s, took, len(now) - reuse, len(now)


def conversation(model: str, threads: int, ctx: int, history: int, turns: int, reply_tokens: int) -> None:
    """A chat that goes on, as the chat app runs it: the engine opened as ``tandem chat``
    opens it (its default drafting, so the model-free drafters index the conversation),
    a chat of ``history`` messages answered once (untimed: the cold prefill), then
    ``turns`` more exchanges, each the previous reply as the model wrote it and a new user
    message, with the time to each reply's first token."""
    from pathlib import Path

    from tandem.runtime.engine.builder import open_engine
    from tandem.runtime.engine.spec import EngineSpec

    engine = open_engine(EngineSpec(Path(model), threads=threads, n_ctx=ctx, suffix_memory="process"))
    chat_engine = ChatEngine(engine.target, engine.strategy, owner=engine)
    msgs = chat(history)
    params = SamplingParams(temperature=0.0)
    try:
        for turn in range(turns + 1):
            start = time.perf_counter()
            first, reply = None, []
            for ev in chat_engine.stream(msgs, params, reply_tokens, keep_start=True):
                if isinstance(ev, TokenEvent):
                    first = first or time.perf_counter() - start
                    reply.append(ev.text)
            prompt = len(chat_engine.fit(msgs, reply_tokens, keep_start=True)[0])
            label = "cold" if turn == 0 else f"{first:.3f} s"
            print(f"turn {len(msgs):4d} messages, {prompt:6d} prompt tokens: TTFT {label}", flush=True)
            msgs = [*msgs, {"role": "assistant", "content": "".join(reply)}, chat(1, seed=turn + 1)[0]]
    finally:
        chat_engine.close()


def drafter_index(tokens: int, turns: int = 3) -> None:
    """What the default model-free drafters (the suffix trie with a shared cache, then
    prompt lookup, as ``--draft-mode auto`` chains them) spend on a chat of ``tokens``
    tokens: indexing it the first time, then on each next turn (the end of the last
    reply re-rendered, a 150-token message, a 64-token reply). No model: the seconds are
    the drafters' own, paid before the reply's first draft."""
    from tandem.runtime.speculative.drafters.chain import ChainDrafter
    from tandem.runtime.speculative.drafters.lookup import PromptLookupDrafter
    from tandem.runtime.speculative.drafters.suffix import GlobalSuffixCache, SuffixDrafter

    rng = random.Random(0)
    sampler = Sampler(SamplingParams(temperature=0.0))
    context = [rng.randrange(151_000) for _ in range(tokens)]
    chain = ChainDrafter([SuffixDrafter(global_cache=GlobalSuffixCache()), PromptLookupDrafter()])
    first = timed(lambda: chain.propose(context, 8, sampler))
    next_turns = []
    for _ in range(turns):
        context = context[:-2] + [rng.randrange(151_000) for _ in range(150)]
        next_turns.append(timed(lambda c=context: chain.propose(c, 8, sampler)))
        context = context + [rng.randrange(151_000) for _ in range(64)]
        chain.propose(context, 8, sampler)
    print(f"drafter index, {tokens} tokens: first {first:.3f} s, next turn {spread(next_turns)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the GGUF file (not read with --drafter-index)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", default="1,51,201", help="chat lengths in messages (odd: the user's turn last)")
    ap.add_argument("--skip-fit", action="store_true")
    ap.add_argument("--modes", default="one-at-a-time,cached")
    ap.add_argument("--count-only", action="store_true", help="fit and count prefill tokens; no model evaluation")
    ap.add_argument("--conversation", type=int, default=0, metavar="N",
                    help="instead: a chat of --turns' first length goes on N more exchanges through the engine "
                         "as `tandem chat` opens it (drafting on); the time to each reply's first token")
    ap.add_argument("--reply-tokens", type=int, default=16, help="with --conversation: each reply's length")
    ap.add_argument("--drafter-index", default="", metavar="N,N",
                    help="instead: what the model-free drafters spend indexing a chat of N tokens, and on its next turns")
    args = ap.parse_args()
    if args.drafter_index:
        for n in (int(t) for t in args.drafter_index.split(",")):
            drafter_index(n)
        return
    if args.model is None:
        ap.error("--model is needed")
    if args.conversation:
        history = int(args.turns.split(",")[0])
        conversation(args.model, args.threads, args.ctx, history, args.conversation, args.reply_tokens)
        return
    target = LlamaCppBackend(args.model, LlamaConfig(n_ctx=args.ctx, n_threads=args.threads))
    if not args.skip_fit:
        fitting(target, args.rounds, args.max_tokens)
    for n in (int(t) for t in args.turns.split(",")):
        for mode in args.modes.split(","):
            fit_s, took, evaluated, prompt = ttft(target, n, args.max_tokens, mode, args.count_only)
            first = "" if took is None else f"TTFT {took:7.2f} s, "
            print(f"turn {n:3d} {mode:14s}: {first}fit {fit_s:.3f} s, prefill {evaluated} of {prompt} prompt tokens",
                  flush=True)
    target.close()


if __name__ == "__main__":
    main()
