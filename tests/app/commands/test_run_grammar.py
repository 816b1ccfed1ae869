"""`tandem run --json-schema FILE` / `--grammar FILE`: replies that follow them; `--predict FILE`; and one
line and a non-zero exit for a file that is missing or does not compile."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tandem.runtime.constrained import GrammarError


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.app.cli", *args], capture_output=True, text=True,
                          timeout=300)


def one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == GrammarError.exit_code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_a_missing_or_invalid_file_fails_before_loading_in_one_line(tmp_path: Path) -> None:
    model = str(tmp_path / "never-opened.gguf")  # the file is read before any model is looked up
    one_line_error(run_cli("run", "-m", model, "-p", "x", "--json-schema", str(tmp_path / "nope.json")),
                   "--json-schema", "nope.json", "cannot read")
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", ')
    one_line_error(run_cli("run", "-m", model, "-p", "x", "--json-schema", str(bad)), "not valid JSON")
    gbnf = tmp_path / "bad.gbnf"
    gbnf.write_text('root ::= "a" (')
    one_line_error(run_cli("run", "-m", model, "-p", "x", "--grammar", str(gbnf)), "--grammar", "GBNF")


def test_run_follows_a_json_schema_and_a_gbnf_grammar(real_models, tmp_path: Path) -> None:
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                       "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}))
    common = ["run", "-m", str(real_models.smollm2), "-n", "96", "--threads", "1", "--json", "--draft-mode", "ngram"]
    out = run_cli(*common, "-p", "Describe Paris as JSON.", "--json-schema", str(schema))
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["stats"]["finish_reason"] == "stop", reply["text"]
    assert reply["stats"]["forced_tokens"] > 0
    record = json.loads(reply["text"])
    assert set(record) == {"city", "country", "population_millions"}
    grammar = tmp_path / "yesno.gbnf"
    grammar.write_text('root ::= ("yes" | "no") ", because " [a-z ]+ "."\n')
    out = run_cli(*common, "-p", "Is the sky blue?", "--grammar", str(grammar))
    assert out.returncode == 0, out.stderr
    text = json.loads(out.stdout)["text"]
    assert re.fullmatch(r"(yes|no), because [a-z ]+\.?", text), text


def test_a_prediction_changes_nothing_in_the_reply_and_a_missing_one_fails_in_one_line(real_models,
                                                                                      tmp_path: Path) -> None:
    """`tandem run --predict FILE`: the file is drafted from (the summary names the
    prediction among the drafters), and the reply is the one without it."""
    code = "def area(w, h):\n    return w * h\n"
    predicted = tmp_path / "area.py"
    predicted.write_text(code)
    common = ["run", "-m", str(real_models.smollm2), "-n", "40", "--threads", "1", "--json", "--temp", "0",
              "-p", f"Repeat this code exactly:\n{code}"]
    without = run_cli(*common)
    with_it = run_cli(*common, "--predict", str(predicted))
    assert without.returncode == 0 and with_it.returncode == 0, with_it.stderr
    assert json.loads(with_it.stdout)["token_ids"] == json.loads(without.stdout)["token_ids"]
    assert json.loads(with_it.stdout)["speculation"]["drafter"].startswith("prediction+")
    missing = run_cli("run", "-m", str(tmp_path / "never-opened.gguf"), "-p", "x", "--predict",
                      str(tmp_path / "nope.py"))
    assert missing.returncode == 5, missing.stderr  # a PromptError: read before any model is looked up
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "--predict" in lines[0] and "cannot read" in lines[0], missing.stderr


def test_a_shaped_reply_cut_by_the_token_limit_is_said(real_models, tmp_path: Path) -> None:
    """Cut by -n, a reply under a schema is not valid under it: a script reading stdout got
    broken JSON with no word of why."""
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                  "required": ["name"]}))
    out = run_cli("run", "-m", str(real_models.smollm2), "-n", "3", "--threads", "1", "-q",
                  "-p", "A person as JSON.", "--json-schema", str(schema))
    assert out.returncode == 0, out.stderr
    assert "tandem: the reply was cut at -n 3 before the grammar was complete" in out.stderr
    whole = run_cli("run", "-m", str(real_models.smollm2), "-n", "64", "--threads", "1", "-q",
                    "-p", "A person as JSON.", "--json-schema", str(schema))
    assert whole.returncode == 0 and "cut at" not in whole.stderr, whole.stderr
    assert "name" in json.loads(whole.stdout)
