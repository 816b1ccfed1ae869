"""Held-out prompts for tuning the adaptive policy: written like the bench's own
(``tandem.app.bench.workloads``: ChatML user turns, four workloads) but never used to
choose a constant, so a change that only fits the bench's 12 prompts shows as a loss here
(``benchmarks/policy_replay.py``)."""

from __future__ import annotations

_CODE_A = '''def load(p):
    f = open(p)
    data = f.read()
    f.close()
    out = {}
    for l in data.split("\\n"):
        if not l:
            continue
        k, v = l.split(":", 1)
        out[k.strip()] = v.strip()
    return out


def save(p, d):
    f = open(p, "w")
    for k in d:
        f.write(k + ": " + str(d[k]) + "\\n")
    f.close()
'''
_CODE_B = '''def stats(xs):
    n = len(xs)
    m = sum(xs) / n
    v = 0
    for x in xs:
        v += (x - m) ** 2
    v = v / (n - 1)
    s = sorted(xs)
    if n % 2 == 1:
        med = s[n // 2]
    else:
        med = (s[n // 2 - 1] + s[n // 2]) / 2
    return {"mean": m, "var": v, "median": med}
'''
_CODE_C = '''class Inv:
    def __init__(self):
        self.items = {}

    def add(self, name, qty):
        if name in self.items:
            self.items[name] += qty
        else:
            self.items[name] = qty

    def rm(self, name, qty):
        if name not in self.items or self.items[name] < qty:
            raise KeyError(name)
        self.items[name] -= qty
        if self.items[name] == 0:
            del self.items[name]
'''
_CODE_D = '''function total(cart) {
  var sum = 0;
  for (var i = 0; i < cart.length; i++) {
    var item = cart[i];
    if (item.qty > 0) {
      sum = sum + item.price * item.qty;
    }
  }
  if (sum > 100) {
    sum = sum * 0.9;
  }
  return Math.round(sum * 100) / 100;
}
'''
_TEXT_A = ("At the regional science fair, the judges were led by Dr. Ingrid Halvorsen, who praised "
          "the robotics entry of Marcus Chen and Leah Abramowitz. Raj Patel won the chemistry prize for "
          "his work on biodegradable plastics, while Sophie Dubois and her partner Kwame Mensah took "
          "second place with a study of river pollution. The event was organised by Theresa Nakamura, "
          "with help from volunteers Diego Alvarez and Hana Kowalski, and closed with a talk by the "
          "astronaut Colonel James Whitfield.")
_TEXT_B = ("Minutes of the board meeting: the chief executive, Laura Jensen, presented the annual "
          "results. The finance director, Omar Siddiqui, explained the new budget, and Beatriz Santos "
          "from the legal team summarised the contract dispute. Two new board members were welcomed, "
          "Ethan Brooks and Yuki Sato. Paolo Ricci asked about the office move, which Ava Thompson "
          "agreed to coordinate with Nikolai Petrov. The secretary, Grace O'Neill, took the minutes.")
EDIT = (
    "Rewrite this Python code to use a `with` statement for files, descriptive names and type hints. "
    "Keep the behaviour the same and reply with the full code only.\n\n```python\n" + _CODE_A + "```",
    "Add type hints and a docstring to this function, and rename the variables to descriptive "
    "names. Reply with the full rewritten code.\n\n```python\n" + _CODE_B + "```",
    "Rename the class `Inv` to `Inventory` and the method `rm` to `remove`, and add a docstring to "
    "each method. Reply with the full updated code.\n\n```python\n" + _CODE_C + "```",
    "Modernise this JavaScript with `const`/`let` and a `for...of` loop; keep the behaviour the same. "
    "Reply with the full code.\n\n```javascript\n" + _CODE_D + "```",
)
EXTRACT = (
    "List every person named in the text below, one per line, as `Full Name - role`, in the order "
    "they appear.\n\n" + _TEXT_A,
    "Make a Markdown table of everyone named in these minutes, with columns Name and Role.\n\n" + _TEXT_B,
    "Extract all people mentioned in the text below as a JSON list of objects with the keys "
    "\"name\" and \"role\".\n\n" + _TEXT_B,
    "Copy every sentence of the text below that mentions a prize, word for word, one per line.\n\n" + _TEXT_A,
)
CODEGEN = (
    "Write a Python function `parse_duration(text)` that turns strings like '1h30m' or '45s' into "
    "seconds. Include type hints, a docstring and error handling.",
    "Write a Python dataclass `Point` with `x` and `y` floats, a `distance_to(other)` method and a "
    "`__add__` method. Include docstrings.",
    "Write a Python function `chunked(iterable, size)` that yields lists of at most `size` items. "
    "Include type hints, a docstring with an example and a check that size is positive.",
    "Write a TypeScript function `groupBy<T, K>(items: T[], key: (item: T) => K): Map<K, T[]>` with a "
    "JSDoc comment and a short usage example.",
)
CHAT = (
    "Explain how garbage collection works in a language like Java or Python, and what the "
    "difference between reference counting and tracing collection is.",
    "Explain what a race condition is, with an example, and describe two common ways to prevent it.",
    "Explain how HTTPS keeps a connection private, step by step, for someone who knows what a "
    "web server is but not what TLS is.",
    "Explain the idea of Big O notation and why an O(n log n) sort is usually preferred over an "
    "O(n^2) one, with a small example.",
)
HELD_OUT: dict[str, tuple[str, ...]] = {"edit": EDIT, "extract": EXTRACT, "codegen": CODEGEN, "chat": CHAT}
