"""`tandem run`: generate from a prompt, streaming text or printing one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from tandem.app.progress import Progress
from tandem.app.terminal_text import StreamCleaner
from tandem.kernels.sampling import Sampler, SamplingParams
from tandem.models.store import resolve_model
from tandem.runtime.backends.opener import backend_kind, open_backend
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.chat import chat_prompt
from tandem.runtime.generate import DoneEvent, GenerationStats, generate
from tandem.runtime.planning.calibration import place
from tandem.runtime.planning.placement import DEVICE_CHOICES, Placed


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
    )


def add_draft_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (lossless)")
    g.add_argument("--draft", default=None, metavar="DRAFTER",
                   help="drafter model: GGUF file or a name from `tandem models` (any vocabulary)")
    g.add_argument("--draft-mode", choices=["auto", "model", "xvocab", "ngram", "off"], default=None,
                   help="auto: model-free drafting, then the drafter (same- or cross-vocabulary), "
                        "adaptive length; ngram: model-free only; default: auto with --draft, else off")
    g.add_argument("--draft-max", type=int, default=8, metavar="N", help="most tokens drafted per round")
    g.add_argument("--draft-len", type=int, default=None, metavar="K",
                   help="fixed draft length instead of the adaptive policy")
    g.add_argument("--fast-verify", action="store_true",
                   help="verify long drafts in one call with llama.cpp's fastest CPU kernels: faster on "
                        "long model-free drafts, but greedy output may differ from plain decoding at near-ties "
                        "(default: exact, token-identical; see README)")


    g.add_argument("--placement", choices=DEVICE_CHOICES, default="auto",
                   help="where drafter and target run: auto measures the options once (cached) and picks the "
                        "fastest: drafter on the GPU or on CPU threads (in turn or split, pre-drafting), or the "
                        "target on the GPU; gpu/cpu: the drafter there; target-gpu: the target there (default: auto)")


def strategy_from_args(target, args: argparse.Namespace, draft_window: int | None = None,
                       placed: Placed | None = None):
    """The speculative strategy the flags ask for (see runtime.speculative.build_strategy)."""
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    mode = args.draft_mode or ("auto" if args.draft else "off")
    placed = placed or Placed()
    options = SpecOptions(mode=mode, draft_max=args.draft_max, draft_length=args.draft_len,
                          draft_window=draft_window, draft_device=placed.draft_device, predraft=placed.predraft,
                          draft_cost=placed.draft_cost)
    return build_strategy(target, placed.draft_path or args.draft, options, llama_config=placed.llama_config,
                          torch_config=placed.torch_config)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a prompt")
    p.add_argument("-m", "--model", required=True, help="GGUF file or a name from `tandem models`")
    p.add_argument("-p", "--prompt", default=None, help="prompt text (default: read standard input)")
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--raw", action="store_true",
                   help="continue the prompt as plain text (default: a user turn in the model's chat template, "
                        "when it has one)")
    p.add_argument("--ctx", type=int, default=None, help="context length (default: the model's, ≤ 4096)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--budget", default=None, help="host memory the run may use, e.g. 6GiB (default: 85%% of "
                   "available RAM); the memory planner fits target + drafter under it (see `tandem plan`)")
    p.add_argument("--vram", default=None, help="GPU memory the run may use, e.g. 4GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no summary (tokens, speed, acceptance) on standard error at the end")
    add_sampling_args(p)
    add_draft_args(p)
    p.set_defaults(func=run)


def open_planned(args: argparse.Namespace) -> tuple[Backend, int | None, Placed]:
    """The target backend, the drafter's context window, and its placement (GGUF only).

    GGUF targets go through the memory planner, which sizes target and drafter to the
    budget (BudgetError if nothing fits), and the drafter's device and threads are chosen
    by :func:`tandem.runtime.planning.placement.place` (measured once, cached); ONNX exports and
    Hugging Face folders are budget-checked (:func:`tandem.runtime.planning.other_targets.plan_unplanned`,
    BudgetError before loading) and then open as they are.
    """
    unplanned = Placed()
    path = resolve_model(args.model)
    if backend_kind(path) != "gguf":
        from tandem.runtime.planning.other_targets import plan_unplanned

        plan_unplanned(path, backend_kind(path), args.budget, args.ctx)
        return open_backend(path, n_ctx=args.ctx, n_threads=args.threads), None, unplanned
    from tandem.runtime.planning.planner import plan_for_run

    wants_model = args.draft and (args.draft_mode or "auto") in ("auto", "model", "xvocab")
    draft_path = resolve_model(args.draft) if wants_model else None
    planned_draft = draft_path if draft_path and backend_kind(draft_path) == "gguf" else None
    plan = plan_for_run(path, planned_draft, args.budget, args.ctx, vram=args.vram, threads=args.threads,
                        draft_max=args.draft_max, drop_slow_draft=False)
    if planned_draft and plan.draft is None:
        print(f"tandem: {plan.reasons[-2] if len(plan.reasons) > 1 else 'draft model dropped'}", file=sys.stderr)
        args.draft = None
    target = open_backend(path, llama_config=replace(plan.target.llama_config(), exact=not args.fast_verify))
    if plan.draft is None:
        return target, None, unplanned
    try:
        placed = place(target, plan, mode=args.draft_mode or "auto", device=args.placement)
    except BaseException:
        target.close()
        raise
    return placed.target, plan.draft.window, placed


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
        lines.append(f"tandem: drafter {drafter or '?'}: {accept}, {stats.tokens_per_call:.2f} tokens per "
                     f"target call ({stats.target_calls} calls)")
    return lines


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


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    with Progress(f"loading {args.model}"):
        target, draft_window, placed = open_planned(args)
    strategy = None
    try:
        with Progress("preparing speculative decoding"):  # the first run measures the verify cost
            strategy = strategy_from_args(target, args, draft_window=draft_window, placed=placed)
        ids, template_stops = run_prompt(target, prompt, raw=args.raw)
        sampler = Sampler(sampling_from_args(args))
        events = generate(target, ids, sampler, strategy=strategy, max_tokens=args.max_tokens,
                          stop=[*template_stops, *args.stop])
        cleaner = StreamCleaner()  # model text may hold escape sequences: never pass them to the terminal
        for event in events:
            if isinstance(event, DoneEvent):
                if args.json:
                    out = {"model": target.name, "prompt": prompt, "text": event.text,
                           "token_ids": event.tokens, "stats": event.stats.as_dict(),
                           "speculation": strategy.describe()}
                    if placed.choice is not None:
                        out["placement"] = placed.choice.as_dict()
                    print(json.dumps(out))
                else:
                    print(cleaner.flush(), flush=True)
                    if not args.quiet:
                        for line in run_summary(event.stats, strategy.describe()):
                            print(line, file=sys.stderr)
            elif not args.json:
                sys.stdout.write(cleaner.feed(event.text))
                sys.stdout.flush()
    finally:
        if strategy is not None:
            strategy.close()
        target.close()
    return 0
