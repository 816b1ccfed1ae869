"""Export a torch-engine model to an ONNX decoder-with-past graph (fp32, optionally int8).

The graph follows the Hugging Face Optimum convention, batch size 1, so the ONNX
backend runs both our exports and Optimum's:

* inputs  ``input_ids`` (1, T) int64, ``logits_index`` (R,) int64 — the positions whose
  logits are wanted (only those rows go through the output head) — and
  ``past_key_values.{i}.key`` / ``.value`` (1, n_head_kv, P, head_dim);
* outputs ``logits`` (1, R, vocab) and ``present.{i}.key`` / ``.value`` (1, n_head_kv,
  P + T, head_dim).

Positions are ``P .. P+T-1``; RoPE cos/sin come from a table precomputed (in float64,
like the torch engine) for the whole context, so the graph has no trigonometry and
matches the torch engine to float32 rounding. The folder also gets ``tandem-onnx.json``
(shapes, context length) and the tokenizer: ``vocab.gguf`` (the GGUF's metadata
without tensors) or the Hugging Face tokenizer files.

Uses torch's TorchScript-based exporter (``dynamo=False``): it needs no extra
dependency (the dynamo exporter needs onnxscript) and traces this model exactly.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from tandem.errors import UnsupportedModel
from tandem.runtime.backends.onnx_meta import FP32_FILE, INT8_FILE, OnnxMeta
from tandem.runtime.backends.torch_engine.cache import PastCache
from tandem.runtime.backends.torch_engine.config import ModelConfig
from tandem.runtime.backends.torch_engine.decoder import LlamaModel, rope_tables
from tandem.runtime.backends.torch_engine.loader import load_weights

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "special_tokens_map.json")


class DecoderWithPast(nn.Module):
    """The model as a pure function of (tokens, wanted rows, past) -> (logits, present)."""

    def __init__(self, model: LlamaModel, n_ctx: int) -> None:
        super().__init__()
        self.model = model
        cfg = model.cfg
        cos, sin = rope_tables(torch.arange(n_ctx), cfg.rotary_dim, cfg.rope_theta, model.rope_freqs, model.dtype)
        self.register_buffer("cos_table", cos)
        self.register_buffer("sin_table", sin)

    def forward(self, input_ids: torch.Tensor, logits_index: torch.Tensor, *past: torch.Tensor):
        past_k = [p[0] for p in past[0::2]]
        past_v = [p[0] for p in past[1::2]]
        cache = PastCache(past_k, past_v)
        ids = input_ids[0]
        positions = torch.arange(ids.shape[0]) + past_k[0].shape[1]
        rope = (self.cos_table[positions], self.sin_table[positions])
        logits = self.model(self.model.embed(ids), positions, cache, None, logits_index, rope)
        present = []
        for k, v in zip(cache.present_k, cache.present_v, strict=True):
            present += [k[None], v[None]]
        return (logits[None], *present)


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    inputs, outputs = ["input_ids", "logits_index"], ["logits"]
    for i in range(n_layers):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def drop_initializer_inputs(path: Path) -> None:
    """Initializers listed as graph inputs become plain constants again (ORT folds them)."""
    import onnx  # local: the [onnx] extra

    proto = onnx.load(str(path))
    names = {t.name for t in proto.graph.initializer}
    kept = [i for i in proto.graph.input if i.name not in names]
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    onnx.save_model(proto, str(path))


def export_graph(model: LlamaModel, path: Path, n_ctx: int, opset: int = 17, *, dedupe: bool = True) -> None:
    """Trace ``model`` to ``path``.

    ``dedupe=False`` keeps weights with identical values as separate tensors. The
    exporter normally merges them, which is right for real models but turns a cost
    twin's many all-zero padding matrices into one, so the graph would read far fewer
    bytes per token than the GGUF it came from; benchmarks export with ``dedupe=False``.
    """
    cfg: ModelConfig = model.cfg
    if cfg.is_moe:
        raise UnsupportedModel("ONNX export of mixture-of-experts models is not supported (routing is data-dependent).")
    wrapper = DecoderWithPast(model, n_ctx).eval()
    inputs, outputs = io_names(cfg.n_layer)
    past_len, new_len = 3, 2  # non-trivial sizes so the tracer keeps both axes symbolic
    past = [torch.zeros(1, cfg.n_head_kv, past_len, cfg.head_dim) for _ in range(2 * cfg.n_layer)]
    args = (torch.zeros(1, new_len, dtype=torch.long), torch.tensor([new_len - 1]), *past)
    axes = {"input_ids": {1: "new"}, "logits_index": {0: "rows"}, "logits": {1: "rows"}}
    for name in inputs[2:]:
        axes[name] = {2: "past"}
    for name in outputs[1:]:
        axes[name] = {2: "total"}
    big = model.weight_bytes() > 1_800_000_000  # protobuf's 2 GB limit: weights go beside
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper, args, str(path), dynamo=False, input_names=inputs, output_names=outputs,
            dynamic_axes=axes, opset_version=opset, do_constant_folding=True,
            keep_initializers_as_inputs=not dedupe,  # the exporter skips de-duplication then
        )
    if not dedupe and not big:
        drop_initializer_inputs(path)
    if big:
        import onnx  # local: the [onnx] extra

        proto = onnx.load(str(path))
        onnx.save_model(proto, str(path), save_as_external_data=True, location=path.name + ".data")


def quantize_int8(src: Path, dst: Path) -> None:
    """Dynamic int8 weight quantization of every MatMul (activations stay float)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic  # local: the [onnx] extra

    big = src.stat().st_size > 1_800_000_000 or Path(str(src) + ".data").exists()
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # quantize_dynamic logs advice about static pre-processing
    try:
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                         use_external_data_format=big)
    finally:
        root.setLevel(level)


def write_vocab_gguf(src: Path, dst: Path) -> None:
    """A tensor-free copy of a GGUF's metadata: the vocabulary llama.cpp can load alone."""
    import gguf  # local: gguf's reader only when a file is read here

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_onnx(
    model_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, int8: bool = False,
    n_ctx: int | None = None, dedupe: bool = True,
) -> list[Path]:
    """Export ``model_path`` (GGUF file or HF folder) into ``out_dir``; returns the graphs written."""
    src, out = Path(model_path), Path(out_dir)
    cfg, weights = load_weights(src, torch.float32, "cpu")
    model = LlamaModel(cfg, weights).eval()
    n_ctx = n_ctx or cfg.n_ctx_train
    out.mkdir(parents=True, exist_ok=True)
    export_graph(model, out / FP32_FILE, n_ctx, dedupe=dedupe)
    written = [out / FP32_FILE]
    if int8:
        quantize_int8(out / FP32_FILE, out / INT8_FILE)
        written.append(out / INT8_FILE)
    if src.is_dir():
        for name in HF_TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copyfile(src / name, out / name)
        tokenizer = "hf"
    else:
        write_vocab_gguf(src, out / "vocab.gguf")
        tokenizer = "vocab.gguf"
    OnnxMeta(n_layer=cfg.n_layer, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, n_vocab=cfg.n_vocab,
             n_ctx_train=n_ctx, tokenizer=tokenizer, source=str(src)).write(out)
    return written
