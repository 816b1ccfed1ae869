"""What a model file was found to hold, remembered per file version.

Opening a GGUF checks things that depend only on the file and the software reading it:
that its weights compute finite logits, whether its vocabulary covers every byte, which
tokens end a generation. Each is a pass over 150 000 tokens or a forward pass, a tenth
of a second or more, and its answer cannot change until the file, the machine or the
software does: it is kept in one small JSON file per model, named by
:func:`tandem.runtime.machine.cache_key` over those (as every per-machine cache is).
A missing, unreadable or unwritable cache only means checking again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tandem.models.paths import cache_dir, write_cache_file
from tandem.runtime.machine import cache_key, file_version, machine_id, software_id

FACTS_VERSION = 1
"""Raised when a fact changes meaning, so older entries are not read as new ones."""

EOG_TOKENS = "end-of-generation tokens"
"""The sorted ids llama.cpp reads as ending a generation."""
COVERS_EVERY_BYTE = "covers every byte"
"""``True`` when the vocabulary can encode any text (no coverage guard needed)."""


def facts_path(model: str | os.PathLike[str]) -> Path | None:
    """The cache file of ``model``'s facts, ``None`` when the file cannot be versioned."""
    try:
        version = file_version(model)
    except OSError:
        return None
    return cache_dir() / "model-facts" / f"{cache_key(version, machine_id(), software_id(), FACTS_VERSION)}.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recall(model: str | os.PathLike[str], name: str) -> Any | None:
    """The fact ``name`` found for this version of ``model``, or ``None``."""
    path = facts_path(model)
    return None if path is None else _read(path).get(name)


def remember(model: str | os.PathLike[str], name: str, value: Any) -> None:
    """Keep ``value`` as the fact ``name`` of this version of ``model`` (best effort)."""
    path = facts_path(model)
    if path is not None:
        write_cache_file(path, json.dumps({**_read(path), name: value}))
