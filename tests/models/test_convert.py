"""HF Llama -> GGUF conversion: exactness against an independent torch forward pass,
tokenizer parity with Hugging Face `tokenizers`, quantized variants, and clear errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tandem.app.cli import main
from tandem.app.commands.twin import agreement, greedy
from tandem.errors import ModelFormatError, ModelNotFound, TandemError, UnsupportedModel
from tandem.models.convert import convert_hf, permute_qk
from tandem.models.gguf_file import inspect_gguf
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig


def load_reference():
    """tests/models/reference_llama.py (tests are not a package; pytest runs in importlib mode)."""
    spec = importlib.util.spec_from_file_location("reference_llama", Path(__file__).with_name("reference_llama.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a big"]
# The 656k vocabulary covers printable ASCII only (no byte tokens), so its texts stay within it.
ASCII_TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  two  spaces\n\nand newlines",
    "\"Yes!\" said Tom; it cost $12345 - no? OK: <fun> | x_y",
    " leading space and trailing ",
    "Hello world",
]
UNICODE_TEXTS = ASCII_TEXTS + ["café naïve Ünïcödé ßtraße", "日本語のテキスト 🙂🚀", "tab\there Ελληνικά\u00a0nbsp"]
CFG = LlamaConfig(n_ctx=256, n_threads=1)


@pytest.fixture(scope="module")
def hf_tok(tinystories656k_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tinystories656k_dir / "tokenizer.json"))


def test_greedy_matches_torch_reference(tinystories656k_gguf, tinystories656k_dir, hf_tok):
    ref = load_reference().ReferenceLlama(tinystories656k_dir)
    with LlamaCppBackend(tinystories656k_gguf, CFG) as llm:
        for prompt in PROMPTS:
            ids = hf_tok.encode(prompt).ids
            assert llm.tokenize(prompt, add_bos=True) == ids
            assert greedy(llm, ids, 64) == ref.greedy(ids, 64), prompt


def test_tokenization_matches_hf(tinystories656k_gguf, hf_tok):
    with LlamaCppBackend(tinystories656k_gguf, CFG) as llm:
        for text in ASCII_TEXTS:
            assert llm.tokenize(text) == hf_tok.encode(text, add_special_tokens=False).ids, text
        assert llm.tokenize("The end.<|end_story|>", special=True)[-1] == 2
        assert llm.special.bos == 1 and llm.special.eos == 2


@pytest.mark.parametrize("family", ["phi-3-mini", "phi-2"])
def test_vocab_conversion_matches_hf_with_unicode(family, hf_tokenizers, tmp_path):
    """SentencePiece-style (phi-3) and byte-level BPE (phi-2) vocabularies, incl. unicode."""
    import llama_cpp
    from tokenizers import Tokenizer

    from tandem.models.hf_tokenizer import read_hf_tokenizer, write_vocab_only

    folder = hf_tokenizers / family
    spec = read_hf_tokenizer(folder)
    assert spec.model == ("llama" if family == "phi-3-mini" else "gpt2")
    path = write_vocab_only(spec, tmp_path / "vocab.gguf")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    try:
        for text in UNICODE_TEXTS:
            assert llm.tokenize(text.encode(), add_bos=False) == hf.encode(text, add_special_tokens=False).ids, text
    finally:
        llm.close()


def test_tied_embeddings_and_layout(tinystories656k_gguf, tinystories656k_dir):
    import gguf
    from safetensors.numpy import load_file

    info = inspect_gguf(tinystories656k_gguf)
    names = {t.name for t in info.tensors}
    assert "output.weight" not in names  # llama.cpp reuses token_embd as the output matrix
    assert info.metadata["tokenizer.ggml.model"] == "llama"
    assert info.metadata["llama.attention.head_count_kv"] == 4
    reader = gguf.GGUFReader(tinystories656k_gguf)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    lm_head = load_file(str(tinystories656k_dir / "model.safetensors"))["lm_head.weight"]
    np.testing.assert_array_equal(np.asarray(embd.data), lm_head)


def _rope(x: np.ndarray, pos: int, pairs: str) -> np.ndarray:
    """Rotate vector ``x`` (one head) at ``pos``: interleaved (llama.cpp) or halves (HF)."""
    d = x.shape[0]
    ang = pos * 10000.0 ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(ang), np.sin(ang)
    if pairs == "interleaved":
        a, b = x[0::2], x[1::2]
        out = np.empty_like(x)
        out[0::2], out[1::2] = a * c - b * s, a * s + b * c
        return out
    a, b = x[: d // 2], x[d // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c])


def test_permute_qk_turns_hf_rope_into_llamacpp_rope():
    """Attention scores with HF weights + rotate-half RoPE equal permuted weights + pair RoPE."""
    rng = np.random.default_rng(0)
    n_head, head_dim, d = 2, 8, 16
    wq, wk = rng.normal(size=(n_head * head_dim, d)), rng.normal(size=(n_head * head_dim, d))
    x, y = rng.normal(size=d), rng.normal(size=d)
    for h in range(n_head):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        hf = _rope(wq[rows] @ x, 5, "halves") @ _rope(wk[rows] @ y, 2, "halves")
        lc = _rope(permute_qk(wq, n_head)[rows] @ x, 5, "interleaved") @ _rope(
            permute_qk(wk, n_head)[rows] @ y, 2, "interleaved"
        )
        assert lc == pytest.approx(hf, rel=1e-9)


@pytest.mark.parametrize(("qtype", "floor"), [("f16", 0.98), ("q8_0", 0.85), ("q4_k_m", 0.7)])
def test_lossy_types_load_and_generate(qtype, floor, tinystories656k_dir, tinystories656k_gguf, tmp_path):
    out = convert_hf(tinystories656k_dir, tmp_path / f"m-{qtype}.gguf", qtype)
    assert inspect_gguf(out).metadata["general.file_type"] == {"f16": 1, "q8_0": 7, "q4_k_m": 15}[qtype]
    with LlamaCppBackend(tinystories656k_gguf, CFG) as f32, LlamaCppBackend(out, CFG) as lossy:
        prompts = [f32.tokenize(p, add_bos=True) for p in PROMPTS]
        result = agreement(f32, lossy, prompts, 64)
    print(f"\n{qtype} vs F32 (656k, 64 greedy tokens): {result}")
    assert result.teacher_forced >= floor


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def test_errors(tinystories656k_dir, tmp_path):
    with pytest.raises(ModelNotFound):
        convert_hf(tmp_path / "missing", tmp_path / "o.gguf")
    with pytest.raises(ModelFormatError, match="config.json"):
        convert_hf(tmp_path, tmp_path / "o.gguf")
    ckpt = _copy_checkpoint(tinystories656k_dir, tmp_path / "ckpt")
    with pytest.raises(TandemError, match="Unknown output type"):
        convert_hf(ckpt, tmp_path / "o.gguf", "q3_k")
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        convert_hf(ckpt, tmp_path / "o.gguf")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="safetensors"):
        convert_hf(ckpt, tmp_path / "o.gguf")
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        convert_hf(ckpt, tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_cli_convert_and_quantize(tinystories656k_dir, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["convert", str(tinystories656k_dir), "-o", str(out), "--type", "f16"]) == 0
    assert main(["quantize", str(out), "-o", str(tmp_path / "q.gguf"), "--type", "q8_0"]) == 0
    assert inspect_gguf(tmp_path / "q.gguf").metadata["general.file_type"] == 7
    assert main(["convert", str(tmp_path / "nope"), "-o", str(out)]) == ModelNotFound.exit_code
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("tandem: error: No such checkpoint folder")
