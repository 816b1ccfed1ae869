"""`tandem run`: generate from a prompt, streaming text or printing one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tandem.app.commands.engine_flags import MODEL_HELP, add_engine_flags, spec_from_args
from tandem.app.commands.sampling_flags import add_sampling_args, sampling_from_args
from tandem.app.progress import Progress
from tandem.app.terminal_text import StreamCleaner
from tandem.errors import PromptError, TandemError
from tandem.kernels.sampling import Sampler
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.chat import chat_prompt
from tandem.runtime.constrained import GrammarError, GrammarSpec, compile_grammar
from tandem.runtime.constrained.grammar import definition
from tandem.runtime.constrained.strategy import constrained
from tandem.runtime.engine.builder import open_engine
from tandem.runtime.generate import NO_LIMIT, DoneEvent, GenerationStats, generate
from tandem.runtime.speculative.drafters.prediction import Prediction


def token_limit(n: int) -> int:
    """``-n``: -1 means up to the context's end (as llama.cpp's and Ollama's)."""
    if n < -1:
        raise TandemError(f"-n/--max-tokens must be -1 (no limit) or more, got {n}.")
    return NO_LIMIT if n == -1 else n


def as_text(raw: str) -> str:
    """A prompt from the command line or standard input as text: bytes that are not UTF-8
    (Python keeps them as lone surrogates, which no tokenizer can encode) become U+FFFD."""
    return raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def given_prompt(flag: str | None, words: list[str]) -> str | None:
    """The prompt from the command line: ``-p`` or the words after the options (joined
    with spaces, as ``ollama run`` does); ``None`` when neither is given (then it is read
    from standard input). Both at once is refused: which one was meant cannot be told."""
    if flag is not None and words:
        raise PromptError("Give the prompt once: with -p or as words after the options, not both.")
    return flag if flag is not None else " ".join(words) if words else None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a prompt")
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("words", nargs="*", metavar="PROMPT",
                   help="the prompt, as in `ollama run MODEL PROMPT` (words are joined with spaces); or -p")
    p.add_argument("-p", "--prompt", default=None, help="prompt text (default: read standard input)")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="reply length limit (default 128; -1: none)")
    p.add_argument("--raw", action="store_true",
                   help="continue the prompt as plain text (default: a user turn in the model's chat template, "
                        "when it has one)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", default=None,
                       help="the reply is JSON valid under the JSON schema in FILE")
    shape.add_argument("--grammar", metavar="FILE", default=None,
                       help="the reply follows the GBNF grammar in FILE (llama.cpp's format)")
    p.add_argument("--predict", metavar="FILE", default=None,
                   help="text the reply is expected to repeat, mostly (the file you ask to have edited): drafted "
                        "from, so the reply comes faster where drafts pay and is the same either way")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="nothing on standard error but errors: no loading progress, no summary at the end")
    add_engine_flags(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run_summary(stats: GenerationStats, speculation: dict | None = None) -> list[str]:
    """What llama.cpp prints after a run, on stderr: tokens, speed, and with a drafter its
    acceptance and tokens per target call (the figures that say whether drafting paid)."""
    timing = f"TTFT {stats.ttft_s * 1000:.0f} ms"
    if stats.generated_tokens > 1 and stats.tokens_per_s > 0:
        timing += f", {stats.tokens_per_s:.1f} tok/s decode"
    lines = [f"tandem: prompt {stats.prompt_tokens} tokens, generated {stats.generated_tokens} in "
             f"{stats.total_s:.2f} s ({timing}), stop: {stats.finish_reason}"]
    drafter = (speculation or {}).get("drafter")
    if drafter or stats.drafted_tokens:
        accept = (f"{stats.accepted_tokens}/{stats.drafted_tokens} drafted tokens accepted "
                  f"({(stats.acceptance_rate or 0) * 100:.1f} %)" if stats.drafted_tokens else "nothing drafted")
        if stats.timing_tokens:  # otherwise a new model's first run reads as drafts that all failed
            accept += (f"; {tokens(stats.timing_tokens)} of them padding that timed this model's verify calls "
                       "(a new model's first runs only)")
        lines.append(f"tandem: drafter {drafter or '?'}: {accept}, {stats.tokens_per_call:.2f} tokens per "
                     f"target call ({stats.target_calls} calls)")
    if (speculation or {}).get("drafter_error"):  # a model opened on first need that failed: decoded without it
        lines.append(f"tandem: {speculation['drafter_error']}")
    elif (speculation or {}).get("drafter_loaded") is False:
        lines.append("tandem: the drafter model was not loaded: no round was worth drafting with it here")
    if stats.forced_tokens:
        lines.append(f"tandem: grammar: {tokens(stats.forced_tokens)} forced, committed without asking the model")
    return lines


def tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def cut_short(stats: GenerationStats, shaped: bool) -> str | None:
    """Said on stderr when a reply held to a schema or grammar was cut by ``-n``: it is then
    not valid under it, and a script reading stdout must know."""
    if shaped and stats.finish_reason == "length":
        return (f"tandem: the reply was cut at -n {stats.generated_tokens} before the grammar was complete: "
                "it is not valid under it (raise -n, or -1 for no limit).")
    return None


def run_prompt(target: Backend, prompt: str, *, raw: bool) -> tuple[list[int], list[str]]:
    """Prompt ids and stop strings: the prompt as a user turn in the model's chat template
    when it has one (as ``ollama run`` and ``llm`` do), or plain text to continue (``raw``,
    or a model without a template)."""
    if not prompt.strip():
        return [], []
    if not raw and target.chat_template():
        return chat_prompt(target, [{"role": "user", "content": prompt}])
    ids = target.tokenize(prompt, add_bos=True)
    if target.special.bos is not None and ids == [target.special.bos]:
        ids = []  # a prompt of only BOS is an empty prompt
    return ids, []


def read_text_file(flag: str, path: str, error: type[TandemError] = TandemError) -> str:
    """A file an option names, read before any model loads: a wrong path fails at once, in
    one line (an ``error``, whose exit code says what kind of input was wrong)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise error(f"{flag} {path}: cannot read the file ({reason}).") from None


def grammar_from_args(args: argparse.Namespace) -> GrammarSpec | None:
    """The ``--json-schema`` / ``--grammar`` file as a spec, read (and a schema parsed)
    before any model loads, so a wrong path or bad JSON fails at once in one line."""
    path, kind = (args.json_schema, "json_schema") if args.json_schema else (args.grammar, "gbnf")
    if path is None:
        return None
    flag = "--json-schema" if kind == "json_schema" else "--grammar"
    spec = GrammarSpec(kind, read_text_file(flag, path, GrammarError))
    try:
        definition(spec)
    except GrammarError as exc:
        raise GrammarError(f"{flag} {path}: {exc}") from None
    return spec


def run(args: argparse.Namespace) -> int:
    spec = grammar_from_args(args)
    predicted = read_text_file("--predict", args.predict, PromptError) if args.predict else ""
    sampling = sampling_from_args(args)
    max_tokens = token_limit(args.max_tokens)
    given = given_prompt(args.prompt, args.words)
    if given is None and sys.stdin.isatty():
        print("tandem: type the prompt, then Ctrl-D (or pass it after the model, or with -p)", file=sys.stderr)
    prompt = as_text(given if given is not None else sys.stdin.read())
    with Progress(f"loading {args.model}", enabled=False if args.quiet else None) as progress:
        engine = open_engine(spec_from_args(args), notify=progress.stage, on_load=progress.fraction)
    with engine:
        for note in engine.notes:
            print(f"tandem: {note}", file=sys.stderr)
        target, strategy = engine.target, engine.strategy
        ids, template_stops = run_prompt(target, prompt, raw=args.raw)
        sampler = Sampler(sampling)
        if predicted:
            strategy = strategy.predicting(Prediction(target.tokenize(predicted)), len(ids))
        decoding = strategy if spec is None else constrained(strategy, compile_grammar(spec, target))
        events = generate(target, ids, sampler, strategy=decoding, max_tokens=max_tokens,
                          stop=[*template_stops, *args.stop])
        cleaner = StreamCleaner()  # model text may hold escape sequences: never pass them to the terminal
        for event in events:
            if isinstance(event, DoneEvent):
                if args.json:
                    out = {"model": target.name, "prompt": prompt, "text": event.text,
                           "token_ids": event.tokens, "stats": event.stats.as_dict(),
                           "speculation": strategy.describe(), "engine": engine.describe()}
                    if engine.placement is not None:
                        out["placement"] = engine.placement.as_dict()
                    print(json.dumps(out))
                else:
                    print(cleaner.flush(), flush=True)
                    if not args.quiet:
                        for line in run_summary(event.stats, strategy.describe()):
                            print(line, file=sys.stderr)
                if (warning := cut_short(event.stats, spec is not None)) is not None:
                    print(warning, file=sys.stderr)
            elif not args.json:
                sys.stdout.write(cleaner.feed(event.text))
                sys.stdout.flush()
    return 0
