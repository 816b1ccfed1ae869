"""Prompts for `tandem bench`: the work people give a local chat model, and the old toys.

Real workloads (rendered through the target's own chat template, so an instruct model
answers as it would in the chat app):

* ``chat``: explain a concept -- free prose, little to copy;
* ``codegen``: write a function -- code with repeated identifiers;
* ``edit``: rewrite code given in the prompt -- most of the answer is already in the
  prompt, which is what model-free drafting (prompt lookup, suffix trees) can copy;
* ``extract``: list the names in a given text -- short spans copied from the prompt.

Each prompt asks for an answer longer than the usual 96-128 benchmarked tokens, so every
configuration decodes real answer text rather than what follows an end-of-turn token.

Toy workloads (for the tiny fixture models and their cost twins, which have no chat
template and do not follow instructions): ``story`` openings, ``random`` token ids, and
``repetitive``: a story asked once before in the process, so the shared suffix tree holds
that request and its answer, as a chat that re-asks or regenerates would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports the workload names: keep that import light
    from tandem.runtime.backends.protocol import Backend

CHAT = (
    "Explain how a hash table works: how keys are turned into positions, what happens when "
    "two keys collide, and why lookups are usually constant time. Use a few paragraphs.",
    "Explain what a database index is, how the database uses it to answer a query, and "
    "when adding an index makes a workload slower rather than faster.",
    "Explain the difference between a process and a thread in an operating system, with an "
    "everyday analogy, and say when you would choose one over the other.",
)

CODEGEN = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals "
    "given as a list of (start, end) tuples and returns them sorted. Include type hints, a "
    "docstring with an example, and handle the empty list.",
    "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` methods that run in "
    "O(1) time, using `collections.OrderedDict`. The constructor takes the capacity. Include "
    "docstrings and type hints.",
    "Write a JavaScript function `debounce(fn, wait)` that returns a debounced version of `fn`, "
    "with a `cancel()` method on the returned function, a JSDoc comment, and a short usage example.",
)

_EDIT_CODE_1 = '''def proc(d, t):
    r = []
    for i in range(len(d)):
        x = d[i]
        if x["status"] == "active" and x["score"] >= t:
            n = x["name"].strip().title()
            s = round(x["score"], 2)
            r.append({"name": n, "score": s, "id": x["id"]})
    r.sort(key=lambda z: z["score"], reverse=True)
    return r


def summ(r):
    tot = 0
    for i in range(len(r)):
        tot = tot + r[i]["score"]
    if len(r) == 0:
        return 0
    return tot / len(r)
'''

_EDIT_CODE_2 = '''class Acct:
    def __init__(self, owner, bal=0):
        self.owner = owner
        self.bal = bal
        self.hist = []

    def dep(self, amt):
        if amt <= 0:
            raise ValueError("amount must be positive")
        self.bal += amt
        self.hist.append(("dep", amt))

    def wd(self, amt):
        if amt > self.bal:
            raise ValueError("insufficient funds")
        self.bal -= amt
        self.hist.append(("wd", amt))

    def report(self):
        lines = []
        for kind, amt in self.hist:
            lines.append(kind + " " + str(amt))
        return "\\n".join(lines)
'''

_EDIT_CODE_3 = '''function parseConfig(text) {
  var result = {};
  var lines = text.split("\\n");
  for (var i = 0; i < lines.length; i++) {
    var line = lines[i].trim();
    if (line === "" || line[0] === "#") {
      continue;
    }
    var eq = line.indexOf("=");
    if (eq === -1) {
      throw new Error("bad line " + (i + 1) + ": " + line);
    }
    var key = line.substring(0, eq).trim();
    var value = line.substring(eq + 1).trim();
    result[key] = value;
  }
  return result;
}
'''

EDIT_CODE = (_EDIT_CODE_1, _EDIT_CODE_2, _EDIT_CODE_3)
"""The code each ``edit`` prompt gives, in order: what a client predicts its reply to be
(OpenAI's Predicted Outputs; `tandem bench --predicted`)."""

EDIT = (
    "Rewrite this Python code with descriptive variable names and type hints. Keep the logic "
    "exactly the same and reply with the full rewritten code only.\n\n```python\n" + _EDIT_CODE_1 + "```",
    "Rename the class `Acct` to `BankAccount`, the method `dep` to `deposit` and `wd` to "
    "`withdraw`, and add a one-line docstring to every method. Reply with the full updated "
    "code.\n\n```python\n" + _EDIT_CODE_2 + "```",
    "Modernise this JavaScript: use `const`/`let` instead of `var` and a `for...of` loop, keep "
    "the behaviour and error messages the same. Reply with the full code.\n\n```javascript\n"
    + _EDIT_CODE_3 + "```",
)

_EXTRACT_TEXT_1 = (
    "The spring meeting of the Harbor Street Community Garden opened with a welcome from the chair, "
    "Margaret Okafor, who thanked Daniel Reyes for repairing the tool shed over the winter. The "
    "treasurer, Priya Natarajan, reported that seed sales had covered the cost of new hoses. "
    "Tomasz Wisniewski proposed a composting workshop, which Aisha Bello offered to lead together "
    "with her neighbour Henrik Lindqvist. Elena Petrova asked who would water the shared beds in "
    "August; Samuel Adeyemi and Chloe Martin volunteered for the first two weeks and Kenji Watanabe "
    "for the rest of the month. The meeting closed after Fatima Zahra read the list of new members, "
    "among them Lucas Moreau, Sofia Rossi and Oliver Bennett."
)

_EXTRACT_TEXT_2 = (
    "Release 4.2 was a team effort. Grace Liu rewrote the query planner, and Mateo Fernandez found "
    "the deadlock that had delayed the beta. Nadia Haddad and Victor Ivanov ported the storage layer "
    "to the new allocator, reviewed by Hannah Schmidt. Documentation was updated by Arjun Mehta, "
    "with screenshots from Zoe Clarke. Our thanks also go to the community contributors Benedikt "
    "Auer, Leila Karimi and Jonas Berg for bug reports, to Mei Tanaka for the Japanese translation, "
    "and to Carlos Mendes, who ran the release process for the first time, mentored by Ruth Goldberg."
)

EXTRACT = (
    "List every person named in the text below, one per line, as `Full Name - role or what they "
    "did`, in the order they appear.\n\n" + _EXTRACT_TEXT_1,
    "Make a Markdown table of every person named in these release notes, with columns Name and "
    "Contribution, in the order they appear.\n\n" + _EXTRACT_TEXT_2,
    "Extract the names of all people mentioned in the text below as a JSON list of objects with "
    "the keys \"first_name\" and \"last_name\".\n\n" + _EXTRACT_TEXT_1,
)

REAL_WORKLOADS: dict[str, tuple[str, ...]] = {"chat": CHAT, "codegen": CODEGEN, "edit": EDIT, "extract": EXTRACT}

STORY_PROMPTS = ("Once upon a time", "The little dog", "Lily and Tom went to the park. They",
                 "One day, a big", "There was a girl named Sue", "The sun was hot and")
TOY_WORKLOADS = ("story", "random", "repetitive")
WORKLOADS = (*REAL_WORKLOADS, *TOY_WORKLOADS)
DEFAULT_WORKLOADS = tuple(REAL_WORKLOADS)


@dataclass
class Workload:
    """Prompt ids for one workload and whether it relies on the shared suffix tree."""

    name: str
    prompts: list[list[int]]
    shared_suffix_cache: bool = False
    """Only ``repetitive`` drafts from earlier requests; every other workload keeps the
    suffix tree per request, so a repetition cannot draft from its own earlier run."""


def max_prompts(workload: str) -> int:
    """How many distinct prompts ``workload`` offers."""
    if workload in REAL_WORKLOADS:
        return len(REAL_WORKLOADS[workload])
    return len(STORY_PROMPTS) // 2


def workload(target: Backend, name: str, count: int) -> Workload:
    """The first ``count`` prompts of workload ``name`` as target token ids."""
    import numpy as np  # local: numpy's import (0.06 s) only when this runs

    from tandem.runtime.chat import chat_prompt

    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}")
    count = min(count, max_prompts(name))
    if name in REAL_WORKLOADS:
        return Workload(name, [chat_prompt(target, [{"role": "user", "content": text}])[0]
                               for text in REAL_WORKLOADS[name][:count]])
    if name == "random":
        bos = [target.special.bos] if target.special.bos is not None else []
        rng = np.random.default_rng(7)
        return Workload(name, [bos + [int(t) for t in rng.integers(3, target.n_vocab, 24)] for _ in range(count)])
    offset = count if name == "repetitive" else 0  # different openings from "story"
    prompts = [target.tokenize(STORY_PROMPTS[(i + offset) % len(STORY_PROMPTS)], add_bos=True) for i in range(count)]
    return Workload(name, prompts, shared_suffix_cache=name == "repetitive")
