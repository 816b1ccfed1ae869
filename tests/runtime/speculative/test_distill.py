"""`tandem distill` on a tiny budget: the drafter loads, shares the target's vocabulary,
drafts better than the same architecture untrained, and the file llama.cpp reads computes
the torch engine's model that was trained."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.app.cli import main
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.speculative.drafters.distill import (
    DistillConfig,
    build_model,
    distill,
    generate_corpus,
    train,
    window_logits,
    write_gguf,
)
from tandem.runtime.speculative.drafters.model import ModelDrafter, same_vocabulary
from tandem.runtime.speculative.loop import speculative
from tandem.runtime.speculative.policy.base import FixedLength

TINY = dict(stories=24, story_tokens=64, n_embd=32, n_layer=1, n_head=2, n_ff=64, batch=8, seq_len=64, seconds=180.0)
"""``seconds`` only caps a slow machine: 150 steps take a few seconds on an idle one, and a
budget that a loaded box runs out of trains a drafter too little to beat an untrained one."""


def _acceptance(target: LlamaCppBackend, drafter_path: Path) -> float:
    with LlamaCppBackend(drafter_path, LlamaConfig(n_ctx=512, n_threads=1)) as backend:
        assert same_vocabulary(target, backend)
        drafter = ModelDrafter(backend, owns_backend=False)
        drafted = accepted = 0
        for text in ["Once upon a time", "One day, a little", "Tom and Sue"]:
            prompt = target.tokenize(text, add_bos=True)
            done = [e for e in generate(target, prompt, Sampler(SamplingParams.greedy_params()),
                                        strategy=speculative(drafter, FixedLength(3)), max_tokens=48)
                    if isinstance(e, DoneEvent)][0]
            drafted += done.stats.drafted_tokens
            accepted += done.stats.accepted_tokens
        return accepted / drafted


def test_distilled_drafter_beats_untrained(stories260k: Path, tmp_path: Path) -> None:
    heard: list[tuple[str, int, int]] = []
    trained = distill(stories260k, tmp_path / "trained.gguf", DistillConfig(steps=150, lr=1e-2, **TINY),
                      on_step=lambda *step: heard.append(step))
    # every story written, then every step trained, each heard once, in order (the CLI's bar)
    assert heard == ([("writing the corpus", i, TINY["stories"]) for i in range(1, TINY["stories"] + 1)]
                     + [("training", i, 150) for i in range(1, trained.steps + 1)])
    untrained = distill(stories260k, tmp_path / "untrained.gguf", DistillConfig(steps=0, **TINY))
    assert trained.loss_last < trained.loss_first
    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512, n_threads=1)) as target:
        a_trained, a_untrained = _acceptance(target, trained.out), _acceptance(target, untrained.out)
    assert a_trained > a_untrained + 0.05, (a_trained, a_untrained)


def test_written_drafter_computes_the_trained_model(stories260k: Path, tmp_path: Path) -> None:
    """The engine's model rotates half-split pairs and the file holds llama.cpp's interleaved
    Q/K rows: after training, llama.cpp on the written GGUF gives the in-memory model's logits."""
    cfg = DistillConfig(steps=20, lr=1e-2, **{**TINY, "stories": 8})
    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512, n_threads=1)) as target:
        corpus, vocab = generate_corpus(target, cfg), target.n_vocab
    model = build_model(vocab, cfg, 2048)
    train(model, corpus, cfg)
    out = write_gguf(model, stories260k, tmp_path / "drafter.gguf")
    ids = [t for story in corpus for t in story][:40]
    with torch.no_grad():
        ours = window_logits(model, torch.tensor([ids]))[0].numpy()
    with LlamaCppBackend(out, LlamaConfig(n_ctx=512, n_threads=1, type_k="f32", type_v="f32")) as drafter:
        ref = drafter.evaluate(ids, range(len(ids)))
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-3)


def test_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["distill", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "x.gguf")]) != 0
    assert main(["distill", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "x.gguf"), "--dim", "0"]) != 0
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err
