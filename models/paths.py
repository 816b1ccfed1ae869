"""Where Tandem keeps user data: platformdirs locations, overridable for tests and portability.

``TANDEM_HOME`` puts everything (models, chats, caches) under one folder.
``TANDEM_MODEL_PATH`` adds extra folders (``os.pathsep``-separated) to search for models.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "tandem"


def data_dir() -> Path:
    home = os.environ.get("TANDEM_HOME")
    path = Path(home) / "data" if home else Path(platformdirs.user_data_dir(APP))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    home = os.environ.get("TANDEM_HOME")
    path = Path(home) / "cache" if home else Path(platformdirs.user_cache_dir(APP))
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def extra_model_dirs() -> list[Path]:
    raw = os.environ.get("TANDEM_MODEL_PATH", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def write_cache_file(path: Path, text: str) -> bool:
    """Write a cache file atomically (a temporary file renamed over it: a reader, or a
    process killed mid-write, never leaves half a file) and best effort: a read-only or
    full cache dir only means measuring again next time. Returns whether it was written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
