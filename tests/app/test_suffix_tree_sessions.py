"""Model-free drafting learns across the user's sessions: a second `tandem run` (a new
process) drafts the reply an earlier one wrote, from the suffix tree kept in the data
dir, and the output stays the target's own.

The runs draft a fixed length: whether a draft pays on the machine at hand is the
adaptive policy's choice (on a 2-core Zen 5, with the cost curve the first run learnt,
it rightly drafts nothing), tested with the policy; this checks what the drafter offers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def _run(model: Path, home: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TANDEM_HOME": str(home)}
    r = subprocess.run([sys.executable, "-m", "tandem.app.cli", "run", "-m", str(model), "-p", PROMPT, "-n", "40",
                        "--threads", "2", "--draft-mode", "ngram", "--draft-len", "8", "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_new_session_drafts_from_the_earlier_sessions(real_models, tmp_path: Path) -> None:
    first = _run(real_models.qwen_05b, tmp_path)
    (saved,) = (tmp_path / "data" / "suffix-tree").glob("*.json")
    second = _run(real_models.qwen_05b, tmp_path)
    assert second["text"] == first["text"]
    s1, s2 = first["stats"], second["stats"]
    print(f"accepted {s1['accepted_tokens']} -> {s2['accepted_tokens']}, calls {s1['target_calls']} -> "
          f"{s2['target_calls']}")
    # The repeat is drafted from the first session's reply: nearly every token accepted.
    assert s2["accepted_tokens"] >= 0.75 * s2["generated_tokens"] > s1["accepted_tokens"]
    assert s2["target_calls"] < s1["target_calls"] / 2
    saved.unlink()  # without the saved tree a new session starts from nothing again
    third = _run(real_models.qwen_05b, tmp_path)
    print(f"without the saved tree: accepted {third['stats']['accepted_tokens']}, calls {third['stats']['target_calls']}")
    assert third["text"] == first["text"] and third["stats"]["target_calls"] > 2 * s2["target_calls"]
