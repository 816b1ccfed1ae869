"""Fuzzing (hypothesis): request bodies against a real server, GGUF metadata against the
header checks and llama.cpp. Bounded to well under a minute; ``TANDEM_FUZZ_EXAMPLES``
raises the example counts for a longer hunt (and prints the status counts)."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import running

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=EXAMPLES or 150, deadline=None, derandomize=not EXAMPLES,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# -- request bodies, written as JSON text so they can hold what json.dumps never makes ---------

SCALARS = st.sampled_from([
    "null", "true", "false", "0", "-1", "1", "2", "8", "9" * 30, "9" * 5000, "-" + "9" * 400, "1e999", "-1e999",
    "NaN", "Infinity", "0.5", "1e-320", '""', '"x"', '"\\ud800"', '"\\udfff a"', '"\\u0000"', '"<|im_end|>"',
    '"\\u001b]0;t\\u0007"', '"' + "y" * 300 + '"', '"text"', '"user"', '"system"', '"assistant"', '"stories"',
])
KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
        "min_p", "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "suffix",
        "input_prefix", "input_suffix", "input_extra", "n_predict", "role", "content", "type", "text",
        "include_usage", "repetition_penalty", "\\ud800", "x",
        "response_format", "json_schema", "grammar", "schema", "strict", "tools", "tool_choice", "parallel_tool_calls",
        "tool_calls", "tool_call_id", "function", "name", "arguments", "parameters", "properties",
        "logit_bias", "17", "presence_penalty", "frequency_penalty", "tokens", "add_special", "parse_special",
        "with_pieces", "ignore_eos", "n_probs"]


def _obj(items: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f'"{k}":{v}' for k, v in items) + "}"


JSON_TEXT = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(st.tuples(st.sampled_from(KEYS), inner), max_size=5).map(_obj),
    ),
    max_leaves=12,
)
MESSAGE = st.one_of(
    JSON_TEXT,
    st.tuples(st.sampled_from(['"user"', '"system"', '"assistant"', '"developer"', '"tool"', "5"]), JSON_TEXT)
    .map(lambda rc: _obj([("role", rc[0]), ("content", rc[1])])),
)
BODY = st.one_of(
    st.lists(st.tuples(st.sampled_from(KEYS), JSON_TEXT), max_size=7).map(_obj),
    st.tuples(st.lists(MESSAGE, max_size=3), st.lists(st.tuples(st.sampled_from(KEYS), JSON_TEXT), max_size=4))
    .map(lambda mk: _obj([("messages", "[" + ",".join(mk[0]) + "]"), ("max_tokens", "4"), *mk[1]])),
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
    st.sampled_from(["[" * 100_000, "{" * 5000, '{"a":' * 3000 + "1" + "}" * 3000, "", "   ", "\x00"]),
)
PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/infill", "/completion", "/tokenize",
                         "/detokenize", "/apply-template"])



@pytest.fixture(scope="module")
def fuzz_server(stories260k):
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    slot = make_slot(LlamaCppBackend(stories260k, LlamaConfig(n_ctx=128, n_threads=1)), name="stories")
    with running(create_app([slot], ServerConfig(max_body_bytes=1 << 20)), start_timeout=20) as url:
        yield url, slot
    slot.close()


def test_fuzzed_requests_never_give_a_5xx(fuzz_server) -> None:
    url, slot = fuzz_server
    counts: collections.Counter = collections.Counter()

    with httpx.Client(timeout=60) as client:
        @FUZZ
        @given(path=PATHS, body=BODY)
        def one(path: str, body: str) -> None:
            r = client.post(f"{url}{path}", content=body.encode("utf-8", "surrogatepass"),
                            headers={"content-type": "application/json"})
            counts[r.status_code // 100 * 100] += 1
            assert r.status_code < 500, (r.status_code, r.text[:500], body[:300])
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                assert r.text.rstrip().endswith("[DONE]") or '"stop": true' in r.text, r.text[-300:]
            else:
                data = r.json()
                if r.status_code >= 400:
                    assert data["error"]["message"]

        one()
        assert client.get(f"{url}/health").json()["status"] == "ok"
    if EXAMPLES:
        print(f"\nfuzzed requests: {sum(counts.values())} -> {dict(sorted(counts.items()))}")


SCHEMA_WORDS = st.sampled_from(['"object"', '"string"', '"integer"', '"number"', '"array"', '"nonsense"',
                                '"function"', '"json_schema"', '"json_object"', '"required"', '"auto"', '"none"',
                                '"root ::= \\"a\\""', '"root ::= x"', '"#/nowhere"', '"^a+$"', '{}', 'true', '[]'])
SCHEMA_KEYS = ["type", "properties", "required", "items", "enum", "minimum", "maximum", "minItems", "maxItems",
               "$ref", "anyOf", "pattern", "additionalProperties", "json_schema", "schema", "strict", "name",
               "function", "parameters", "format", "const"]
SCHEMA_JSON = st.recursive(
    st.one_of(SCALARS, SCHEMA_WORDS),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(st.tuples(st.sampled_from(SCHEMA_KEYS), inner), max_size=4).map(_obj)),
    max_leaves=12)
STRUCTURED = st.sampled_from(["response_format", "json_schema", "grammar", "tools", "tool_choice"])


def test_fuzzed_formats_and_tools_never_give_a_5xx(fuzz_server) -> None:
    """Schemas, grammars and tool lists that cannot compile (or can) get a 4xx or a reply."""
    url, _ = fuzz_server

    with httpx.Client(timeout=60) as client:
        @FUZZ
        @given(path=PATHS, fields=st.lists(st.tuples(STRUCTURED, SCHEMA_JSON), min_size=1, max_size=2))
        def one(path: str, fields: list[tuple[str, str]]) -> None:
            base = '"messages":[{"role":"user","content":"Hi"}],"prompt":"Hi","max_tokens":3,"n_predict":3,'
            body = "{" + base + _obj(fields)[1:]
            r = client.post(f"{url}{path}", content=body.encode(), headers={"content-type": "application/json"})
            assert r.status_code < 500, (r.status_code, r.text[:500], body[:300])
            if r.status_code >= 400:
                assert r.json()["error"]["message"]

        one()


# -- GGUF metadata --------------------------------------------------------------------------

FIELDS = ["llama.block_count", "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
          "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.layer_norm_rms_epsilon",
          "llama.rope.dimension_count"]
NUMBERS = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 64, 1000, 2**31 - 1, 2**32 - 1]),
                    st.integers(0, 2**32 - 1))
FLOATS = st.one_of(st.sampled_from([0.0, -1e-5, float("nan"), float("inf"), 1e-5, 1.0, 1e30]),
                   st.floats(allow_nan=True, allow_infinity=True, width=32))

LOAD_BATCH = """
import json, sys
from tandem.errors import TandemError
from tandem.runtime.backends.llama import LlamaConfig, LlamaCppBackend
for path in json.loads(sys.stdin.read()):
    try:
        LlamaCppBackend(path, LlamaConfig(n_ctx=64, n_threads=1)).close()
        print("ok", flush=True)
    except TandemError as exc:
        print("error", flush=True)
"""


def test_fuzzed_metadata_is_refused_or_loads(stories260k: Path, tmp_path: Path) -> None:
    """Random values in the hyperparameters llama.cpp trusts: the header checks refuse
    them with a ModelFormatError, or llama.cpp loads the file (or refuses it cleanly) —
    checked in one subprocess at the end, so a native abort fails this test instead of
    killing the run."""
    import gguf

    from tandem.errors import TandemError
    from tandem.models.gguf_file import check_runnable, inspect_gguf

    passed: list[str] = []
    outcome: collections.Counter = collections.Counter()

    @settings(max_examples=EXAMPLES or 60, deadline=None, derandomize=not EXAMPLES,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.tuples(st.sampled_from(FIELDS), NUMBERS, FLOATS), min_size=1, max_size=3))
    def one(changes) -> None:
        path = tmp_path / f"m{len(passed)}-{outcome.total()}.gguf"
        shutil.copyfile(stories260k, path)
        reader = gguf.GGUFReader(path, "r+")
        for key, number, real in changes:
            part = reader.fields[key].parts[reader.fields[key].data[0]]
            part[0] = real if part.dtype.kind == "f" else number
        reader.data.flush()
        del reader
        try:
            check_runnable(inspect_gguf(path))
        except TandemError:
            outcome["refused by the header checks"] += 1
            path.unlink()
            return
        passed.append(str(path))

    one()
    proc = subprocess.run([sys.executable, "-c", LOAD_BATCH], input=json.dumps(passed), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # negative: llama.cpp aborted
    lines = proc.stdout.split()
    assert len(lines) == len(passed)
    outcome.update({"loaded": lines.count("ok"), "refused by llama.cpp": lines.count("error")})
    assert outcome["refused by the header checks"] > 0
    if EXAMPLES:
        print(f"\nfuzzed GGUF headers: {outcome.total()} -> {dict(outcome)}")
