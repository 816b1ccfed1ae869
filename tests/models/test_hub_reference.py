"""How `tandem pull` reads a model reference and picks a file: pure, no hub."""

from __future__ import annotations

import pytest

from tandem.errors import TandemError
from tandem.models.hub import HubReference, has_tag, parse_reference, pick_gguf

REPO = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"
FILES = ["README.md", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-1.5b-instruct-q8_0.gguf",
         "qwen2.5-coder-1.5b-instruct-iq4_xs.gguf", "qwen2.5-coder-1.5b-instruct-q4_k_l.gguf",
         "mmproj-qwen2.5-f16.gguf"]


@pytest.mark.parametrize(("text", "want"), [
    (REPO, HubReference(REPO)),
    (f"{REPO}:Q4_K_M", HubReference(REPO, tag="Q4_K_M")),
    (f"hf.co/{REPO}:q8_0", HubReference(REPO, tag="q8_0")),
    (f"https://huggingface.co/{REPO}", HubReference(REPO)),
    (f"https://huggingface.co/{REPO}/", HubReference(REPO)),
    (f"https://huggingface.co/{REPO}/tree/main", HubReference(REPO)),
    (f"https://huggingface.co/{REPO}/blob/main/x-q8_0.gguf", HubReference(REPO, "x-q8_0.gguf")),
    (f"huggingface.co/{REPO}/resolve/v1.0/sub/x.gguf?download=true", HubReference(REPO, "sub/x.gguf", revision="v1.0")),
])
def test_references_as_the_other_tools_write_them(text: str, want: HubReference) -> None:
    assert parse_reference(text) == want


def test_a_file_named_twice_must_agree_and_a_tag_goes_alone() -> None:
    assert parse_reference(REPO, "a.gguf") == HubReference(REPO, "a.gguf")
    assert parse_reference(f"{REPO}/blob/main/a.gguf", "a.gguf") == HubReference(REPO, "a.gguf")
    with pytest.raises(TandemError, match="give one"):
        parse_reference(f"{REPO}/blob/main/a.gguf", "b.gguf")
    with pytest.raises(TandemError, match="give one"):
        parse_reference(f"{REPO}:Q8_0", "a.gguf")
    with pytest.raises(TandemError, match="not a quantization tag"):
        parse_reference(f"{REPO}:Q8 0")
    with pytest.raises(TandemError, match="not a valid Hugging Face repository id"):
        parse_reference("hf.co/a/b/c:Q8_0")


def test_a_tag_is_a_whole_word_in_any_case() -> None:
    assert has_tag("model-q4_k_m.gguf", "Q4_K_M") and has_tag("Model.Q4_K_M.gguf", "q4_k_m")
    assert not has_tag("model-Q4_K_M_L.gguf", "Q4_K_M")
    assert not has_tag("model-IQ4_XS.gguf", "Q4_XS") and has_tag("model-IQ4_XS.gguf", "iq4_xs")
    assert has_tag("dir/model-Q8_0-00001-of-00002.gguf", "Q8_0")


def test_the_file_taken_and_why() -> None:
    assert pick_gguf(REPO, FILES, "Q8_0") == ("qwen2.5-coder-1.5b-instruct-q8_0.gguf", None)
    name, why = pick_gguf(REPO, FILES, None)  # several: the Q4_K_M one, said so
    assert name == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert why is not None and "4 GGUF files" in why and f"{REPO}:TAG" in why
    assert pick_gguf(REPO, ["one.gguf", "mmproj-x.gguf"], None) == ("one.gguf", None)  # a projector is no model


@pytest.mark.parametrize(("files", "tag", "says"), [
    (FILES, "Q2_K", "holds 0 GGUF files with the tag 'Q2_K'"),
    (["a-q8_0.gguf", "b-q5_0.gguf"], None, "holds 0 GGUF model files"),
    (["a-q8_0.gguf", "b-q8_0.gguf"], "Q8_0", "holds 2 GGUF files with the tag 'Q8_0'"),
    (["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"], "Q8_0", "split into 2 files"),
    (["README.md"], None, "no model to pull"),
])
def test_what_the_user_must_choose_is_listed(files: list[str], tag: str | None, says: str) -> None:
    with pytest.raises(TandemError, match=says) as info:
        pick_gguf(REPO, files, tag)
    models = [f for f in files if f.endswith(".gguf") and not f.startswith("mmproj")]
    assert all(f in str(info.value) for f in models[:1 if "split" in says else None])
