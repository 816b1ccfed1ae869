"""`/infill` as llama.vscode calls it, served by a quantized Qwen2.5-Coder on the GPU (the
GPU tier: skipped unless llama.cpp, as built here, lists a GPU). Greedy so that a
request repeated on a warm cache must give the same reply, and streamed must equal
whole. The kit's models have random weights, so the fill itself is not checked."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from gpu_models import gpu_models, needs_gpu_build
from live_server import running

pytestmark = needs_gpu_build
REQUESTS = Path(__file__).parent / "infill_requests"


@pytest.fixture(scope="module")
def gpu_server(request: pytest.FixtureRequest):
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    target = LlamaCppBackend(gpu_models(request).drafter, LlamaConfig(n_ctx=2048, n_gpu_layers=-1))
    assert target.memory().device == "cuda"
    slot = make_slot(target, name="qwen-gpu")
    with running(create_app([slot], ServerConfig()), start_timeout=60) as url:
        yield url
    slot.close()


def test_infill_on_the_gpu(gpu_server: str) -> None:
    body = json.loads((REQUESTS / "llama_vscode_fim.json").read_text()) | {"n_predict": 16, "top_k": 1}
    first = httpx.post(f"{gpu_server}/infill", json=body, timeout=120)
    assert first.status_code == 200, first.text
    again = httpx.post(f"{gpu_server}/infill", json=body, timeout=120).json()
    assert again["content"] == first.json()["content"]
    assert again["tokens_cached"] >= again["tokens_evaluated"] - 1  # the warm cache was reused
    with httpx.stream("POST", f"{gpu_server}/infill", json=body | {"stream": True}, timeout=120) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert "".join(e["content"] for e in events) == first.json()["content"]
    assert events[-1]["stop"] is True
