"""A long chat in the chat app evaluates only its new turn: the previous turns' KV cache
is kept between replies, also once the chat has outgrown the context (turns are left
out in runs, so the prompt's start stays put). Real model, real history database."""

from __future__ import annotations

import random

from tandem.app.history.database import History
from tandem.app.tui.session import ChatSettings, run_reply
from tandem.kernels.sampling_params import SamplingParams

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "programmers", "argue", "about", "tabs"]


def test_a_long_chat_prefills_only_the_new_turn(real_models, tmp_path) -> None:
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.chat import ChatEngine

    b = LlamaCppBackend(real_models.smollm2, LlamaConfig(n_ctx=512, n_threads=1))
    evaluated: list[int] = []
    inner = b.evaluate

    def counting(tokens, logits_for=None):
        evaluated.append(len(tokens))
        return inner(tokens, logits_for)

    b.evaluate = counting
    engine = ChatEngine(b)
    rng = random.Random(11)
    per_reply: list[tuple[int, int]] = []  # (tokens evaluated, prompt tokens)
    try:
        with History(tmp_path / "h.db") as history:
            chat = history.create_chat("long", params=ChatSettings(SamplingParams(temperature=0.0), 8).to_dict())
            for _ in range(36):
                history.add_message(chat.id, "user", " ".join(rng.choice(WORDS) for _ in range(10)))
                evaluated.clear()
                reply = run_reply(engine, history, history.get_chat(chat.id), model_name="smollm2")
                per_reply.append((sum(evaluated), reply.stats["prompt_tokens"]))
    finally:
        b.close()
    full = [i for i, (_, prompt) in enumerate(per_reply) if prompt > 440]  # near the room (504 tokens)
    assert full, "the chat never outgrew the context"
    after = per_reply[full[0] + 1:]
    cheap = [n for n, _ in after if n <= 60]  # the new user turn, the reply, a few template tokens
    assert len(after) >= 12
    assert len(cheap) >= 0.75 * len(after), per_reply
