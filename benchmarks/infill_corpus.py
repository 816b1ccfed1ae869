"""The fill-in-the-middle corpus of ``bench_infill``: 30 holes in small Python files.

Each snippet marks its hole with ``⟪`` and ``⟫``; the cursor sits at ``⟪``. Twenty are
the rest of the cursor line; ten are a block body with the cursor after its indentation
(four of them span several lines, the other six are one statement). Written for this benchmark; the right
fill is the marked text, judged by exact match (see :func:`fill_matches`).
"""

from __future__ import annotations

from dataclasses import dataclass

SNIPPETS: tuple[str, ...] = (
    # -- single line ------------------------------------------------------------------
    "def add(a, b):\n    return ⟪a + b⟫\n\n\nprint(add(2, 3))\n",
    "def is_even(n):\n    return ⟪n % 2 == 0⟫\n\n\nassert is_even(4)\n",
    "import os\n\n\ndef config_path(home):\n    return os.path.join(⟪home, \".config\", \"app.toml\")⟫\n",
    "def mean(values):\n    if not values:\n        return 0.0\n    return ⟪sum(values) / len(values)⟫\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        ⟪self.y = y⟫\n\n    def norm(self):\n"
    "        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
    "def read_lines(path):\n    with open(path) as f:\n        return ⟪f.read().splitlines()⟫\n",
    "def square_all(xs):\n    return [⟪x * x for x in xs]⟫\n",
    "def invert(d):\n    return {⟪v: k for k, v in d.items()}⟫\n",
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return ⟪json.load(f)⟫\n",
    "def greet(name):\n    return f\"Hello, ⟪{name}!\"⟫\n\n\nprint(greet(\"Ada\"))\n",
    "def clamp(x, lo, hi):\n    return ⟪max(lo, min(x, hi))⟫\n",
    "def factorial(n):\n    if n <= 1:\n        return 1\n    return ⟪n * factorial(n - 1)⟫\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return ⟪fib(n - 1) + fib(n - 2)⟫\n",
    "from pathlib import Path\n\n\ndef python_files(root):\n    return sorted(Path(root).rglob(⟪\"*.py\"))⟫\n",
    "def count_words(text):\n    return len(⟪text.split())⟫\n",
    "def last(items):\n    return ⟪items[-1]⟫\n",
    "import sys\n\n\ndef main():\n    print(\"usage: tool FILE\", file=⟪sys.stderr)⟫\n    return 2\n",
    "def reverse(s):\n    return ⟪s[::-1]⟫\n",
    "def celsius_to_fahrenheit(c):\n    return ⟪c * 9 / 5 + 32⟫\n",
    "def unique(items):\n    return ⟪list(set(items))⟫\n",
    # -- block bodies -------------------------------------------------------------------
    "def maximum(values):\n    best = values[0]\n    for v in values[1:]:\n        ⟪if v > best:\n            best = v⟫\n"
    "    return best\n",
    "def count_chars(text):\n    counts = {}\n    for ch in text:\n        ⟪counts[ch] = counts.get(ch, 0) + 1⟫\n"
    "    return counts\n",
    "def sum_list(xs):\n    total = 0\n    for x in xs:\n        ⟪total += x⟫\n    return total\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        "
    "⟪self.items.append(item)⟫\n\n    def pop(self):\n        return self.items.pop()\n",
    "def read_config(path):\n    try:\n        with open(path) as f:\n            return f.read()\n    "
    "except FileNotFoundError:\n        ⟪return None⟫\n",
    "def evens(xs):\n    out = []\n    for x in xs:\n        ⟪if x % 2 == 0:\n            out.append(x)⟫\n"
    "    return out\n",
    "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n"
    "        if xs[mid] == target:\n            return mid\n        ⟪if xs[mid] < target:\n            lo = mid + 1\n"
    "        else:\n            hi = mid - 1⟫\n    return -1\n",
    "class Counter:\n    def __init__(self):\n        ⟪self.count = 0⟫\n\n    def increment(self):\n"
    "        self.count += 1\n",
    "def flatten(nested):\n    result = []\n    for sub in nested:\n        ⟪result.extend(sub)⟫\n    return result\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):\n        "
    "⟪if n % i == 0:\n            return False⟫\n    return True\n",
)


@dataclass(frozen=True)
class Hole:
    prefix: str
    """Lines before the cursor line (llama.vim's ``input_prefix``)."""
    prompt: str
    """The cursor line up to the cursor (``prompt``)."""
    suffix: str
    """From the cursor to the end of the file (``input_suffix``)."""
    answer: str

    @property
    def multi_line(self) -> bool:
        return "\n" in self.answer

    @property
    def indent(self) -> int:
        return len(self.prompt) - len(self.prompt.lstrip(" \t"))


def parse_hole(snippet: str) -> Hole:
    before, rest = snippet.split("⟪", 1)
    answer, after = rest.split("⟫", 1)
    line_start = before.rfind("\n") + 1
    return Hole(before[:line_start], before[line_start:], after, answer)


def holes() -> list[Hole]:
    return [parse_hole(s) for s in SNIPPETS]


def fill_matches(hole: Hole, content: str) -> bool:
    """Exact match: the suggestion's first lines (as many as the answer has) equal the
    answer's, trailing blanks aside; what follows them is not judged."""
    want = [line.rstrip() for line in hole.answer.split("\n")]
    got = [line.rstrip() for line in content.split("\n")][: len(want)]
    return got == want
