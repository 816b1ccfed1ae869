"""The local model store: GGUF files in the data dir, extra folders, and the Hugging Face cache.

Pulled models stay in the Hugging Face hub cache (shared with other tools, never
downloaded twice); files the user drops into ``models_dir()`` or a folder in
``TANDEM_MODEL_PATH`` are found too. Nothing here touches the network: pulling is
:mod:`tandem.models.hub`.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.errors import ModelNotFound, TandemError
from tandem.models.gguf_file import inspect_gguf
from tandem.models.hub import cached_hub_files, parse_reference, pick_gguf
from tandem.models.paths import extra_model_dirs, models_dir


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    size_bytes: int
    architecture: str | None
    source: str
    """``local``, ``path`` (TANDEM_MODEL_PATH) or ``hub:<repo>``."""

    def as_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def _entry(path: Path, name: str, source: str) -> ModelEntry:
    try:
        arch = inspect_gguf(path).architecture
    except TandemError:
        arch = None
    return ModelEntry(name, path, path.stat().st_size, arch, source)


def _hub_entries() -> list[ModelEntry]:
    return [_entry(f.path, f"{f.repo_id}/{f.path.name}", f"hub:{f.repo_id}")
            for f in cached_hub_files() if f.path.name.endswith(".gguf")]


def list_models() -> list[ModelEntry]:
    """Every GGUF file Tandem can find, local files first, without duplicates."""
    entries: list[ModelEntry] = []
    for folder, source in [(models_dir(), "local"), *((d, "path") for d in extra_model_dirs())]:
        if folder.is_dir():
            for path in sorted(folder.rglob("*.gguf")):
                entries.append(_entry(path, path.stem, source))
    entries.extend(_hub_entries())
    seen: set[tuple[int, int]] = set()
    unique = []
    for e in entries:
        identity = file_identity(e.path)
        if identity not in seen:
            seen.add(identity)
            unique.append(e)
    return unique


def file_identity(path: Path) -> tuple[int, int]:
    """(device, inode): one file however it is reached (nested search folders, symlinks,
    hard links, relative paths) is listed once."""
    st = path.stat()
    return st.st_dev, st.st_ino


def resolve_model(name_or_path: str) -> Path:
    """A path as given, or a store entry by name, file stem or ``repo/file``."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    return store_entry(name_or_path).path


def store_entry(name_or_path: str) -> ModelEntry:
    """The store's entry named ``name_or_path`` (name, file stem, ``repo/file``), or the one
    that is that file."""
    entries = list_models()
    path = Path(name_or_path).expanduser()
    if path.exists():
        identity = file_identity(path)
        matches = [e for e in entries if file_identity(e.path) == identity]
        if not matches:
            raise ModelNotFound(f"{path} is not in the store (`tandem models` lists what is).")
        return matches[0]
    matches = [e for e in entries if name_or_path in (e.name, e.path.stem, e.path.name)]
    if len(matches) > 1:
        listing = "\n  ".join(str(e.path) for e in matches)
        raise ModelNotFound(
            f"{name_or_path!r} names {len(matches)} different files; give one by its path:\n  {listing}"
        )
    if matches:
        return matches[0]
    pulled = pulled_as(name_or_path, entries)
    if pulled is not None:
        return pulled
    known = ", ".join(e.name for e in entries[:8]) or "none yet"
    how = (f"Pull it with `tandem pull {name_or_path}`" if "/" in name_or_path
           else "Pull one with `tandem pull OWNER/REPO:Q4_K_M`")
    raise ModelNotFound(f"No model {name_or_path!r}: not a file, and not in the store (known: {known}). {how}.")


def pulled_as(reference: str, entries: list[ModelEntry]) -> ModelEntry | None:
    """The pulled file that a hub reference names (``owner/name:Q4_K_M``, ``hf.co/…``, a
    file's address), chosen among what is cached as `tandem pull` chose it: a model is
    run by the reference it was pulled with. ``None`` when nothing of that repository is
    cached (or ``reference`` is no hub reference)."""
    try:
        ref = parse_reference(reference)
    except TandemError:
        return None
    pulled = {e.name.removeprefix(f"{ref.repo_id}/"): e for e in entries if e.source == f"hub:{ref.repo_id}"}
    if not pulled:
        return None
    if ref.filename is not None:
        return pulled.get(ref.filename)
    name, _ = pick_gguf(ref.repo_id, sorted(pulled), ref.tag)  # several and no tag: the choices, listed
    return pulled[name]


def remove_model(entry: ModelEntry) -> int:
    """Delete a model from the store; the bytes freed. A pulled file leaves the hub cache
    with its data, from every revision that holds the same data (the store lists it
    once); a file in the data dir is deleted; files in ``TANDEM_MODEL_PATH`` folders are
    the user's own and stay."""
    if entry.source == "path":
        raise TandemError(f"{entry.path} is in a folder of TANDEM_MODEL_PATH: Tandem only lists it; "
                          "delete it yourself if you mean to.")
    path = entry.path
    freed = path.stat().st_size
    if not (entry.source.startswith("hub:") and path.is_symlink()):
        path.unlink()  # a local file, or a hub cache that copies files (no symlinks on this system)
        return freed
    data = path.resolve()
    snapshots = path.parents[1]  # models--owner--name/snapshots/<revision>/<file>
    for link in [p for p in snapshots.rglob("*") if p.is_symlink() and p.resolve() == data]:
        link.unlink()
        if not any(link.parent.iterdir()):
            _drop_revision(link.parent)
    data.unlink()
    if not any(snapshots.iterdir()):  # nothing left of the repository
        shutil.rmtree(snapshots.parent)
    return freed


def _drop_revision(revision: Path) -> None:
    """Remove an emptied snapshot folder and the refs naming it (huggingface-hub treats a
    ref to a missing revision as a corrupted cache and skips the whole repository)."""
    revision.rmdir()
    refs = revision.parents[1] / "refs"
    for ref in refs.rglob("*") if refs.is_dir() else ():
        if ref.is_file() and ref.read_text().strip() == revision.name:
            ref.unlink()
