"""The local model store: GGUF files in the data dir, extra folders, and the Hugging Face cache.

Pulled models stay in the Hugging Face hub cache (shared with other tools, never
downloaded twice); files the user drops into ``models_dir()`` or a folder in
``TANDEM_MODEL_PATH`` are found too. Nothing here touches the network except
:func:`pull`, and that honours ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from tandem.errors import ModelFormatError, ModelNotFound, OfflineError, TandemError
from tandem.models.gguf_file import inspect_gguf
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
    try:
        # local: the hub client only when downloads are asked about
        from huggingface_hub import constants, scan_cache_dir
        from huggingface_hub.errors import CacheNotFound
    except ImportError:  # pragma: no cover - huggingface-hub is a dependency
        return []
    try:
        info = scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:
        return []
    out = []
    for repo in info.repos:
        for rev in repo.revisions:
            for f in rev.files:
                if f.file_name.endswith(".gguf"):
                    out.append(_entry(Path(f.file_path), f"{repo.repo_id}/{f.file_name}", f"hub:{repo.repo_id}"))
    return out


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
    known = ", ".join(e.name for e in entries[:8]) or "none yet"
    raise ModelNotFound(
        f"No model {name_or_path!r}: not a file, and not in the store (known: {known}). "
        "Pull one with `tandem pull REPO FILE`."
    )


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


REPO_ID_EXAMPLE = "ggml-org/models"
"""What a repository id looks like, named in the error for one that is not."""

OFFLINE_HINT = "check the network, or set HF_HUB_OFFLINE=1 to use only what is cached"
"""What to do when the hub cannot be reached, said after why."""


@dataclass(frozen=True)
class PullSource:
    """What :func:`download` fetches, settled before any byte moves.

    A pull is two steps so that the CLI can show a progress line while the hub is
    reached and listed, then leave the terminal to the hub's own download bar.
    """

    repo_id: str
    filename: str
    unreachable: str | None = None
    """Why the hub could not be reached (then only the local cache is read), or None."""


def _silent(stage: str) -> None:
    """The default ``notify``: a pull from code reports no stages."""


def pull(repo_id: str, filename: str | None = None) -> Path:
    """Download a GGUF file from the Hugging Face hub (or find it in the cache offline).

    Without ``filename`` the repository must hold exactly one ``.gguf`` file, or the
    error lists the choices. Every failure is a :class:`TandemError` of one line.
    """
    return download(prepare_pull(repo_id, filename))


def prepare_pull(repo_id: str, filename: str | None = None, *,
                 notify: Callable[[str], None] = _silent) -> PullSource:
    """Check ``repo_id``, reach the hub (unless offline) and pick the file to download.

    ``notify`` hears each stage that may take a while ("reaching …", "listing …"). A hub
    that cannot be reached is an error unless the file is named: then a copy already in
    the cache still serves, as the hub client itself would do.
    """
    check_repo_id(repo_id)
    if offline():
        if filename is None:
            raise OfflineError(
                f"Offline (HF_HUB_OFFLINE is set): name the file to pull from {repo_id}, "
                "or unset HF_HUB_OFFLINE to list the repository."
            )
        return PullSource(repo_id, filename)
    endpoint = hub_endpoint()
    notify(f"reaching {endpoint}")
    why = hub_unreachable()
    if why is not None:
        if filename is None:
            raise OfflineError(unreachable_message(endpoint, why))
        return PullSource(repo_id, filename, unreachable=why)
    if filename is None:
        notify(f"listing {repo_id}")
        # local: the hub client only when downloads are asked about
        from huggingface_hub import list_repo_files

        with _hub_errors(repo_id, None):
            filename = only_gguf(repo_id, list_repo_files(repo_id))
    return PullSource(repo_id, filename)


def download(source: PullSource) -> Path:
    """The file ``source`` names, from the hub or, offline or when the hub cannot be
    reached, from the local cache; checked to be a GGUF file when it is named like one."""
    # local: the hub client only when downloads are asked about
    from huggingface_hub import hf_hub_download

    local_only = offline() or source.unreachable is not None
    with _hub_errors(source.repo_id, source.filename, source.unreachable):
        path = Path(hf_hub_download(source.repo_id, source.filename, local_files_only=local_only))
    if source.filename.endswith(".gguf"):
        try:
            inspect_gguf(path)
        except ModelFormatError as exc:
            raise ModelFormatError(f"Downloaded file is not a valid GGUF: {exc}") from None
    return path


def only_gguf(repo_id: str, files: list[str]) -> str:
    """The one ``.gguf`` file among a repository's ``files``; with none or several the
    user must choose, so the error lists them."""
    choices = [f for f in files if f.endswith(".gguf")]
    if len(choices) != 1:
        listing = "\n  ".join(choices) or "(no .gguf files)"
        raise TandemError(f"{repo_id} holds {len(choices)} GGUF files; pick one:\n  {listing}")
    return choices[0]


def check_repo_id(repo_id: str) -> None:
    """Refuse a malformed repository id before any network call: the hub client's own
    check raises a ``ValueError`` (a traceback) from inside the first request."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise TandemError(invalid_repo_id_message(repo_id)) from None


def invalid_repo_id_message(repo_id: str) -> str:
    """One line naming the bad id (``!r``: a control character in it stays visible) and
    what a good one looks like."""
    return (f"{repo_id!r} is not a valid Hugging Face repository id: it looks like owner/name "
            f"(e.g. {REPO_ID_EXAMPLE}), of letters, digits, '-', '_' and '.'")


def unreachable_message(endpoint: str, why: str) -> str:
    """One line for a hub that cannot be reached: where, why, and what to do."""
    return f"cannot reach the Hugging Face hub at {endpoint}: {why}; {OFFLINE_HINT}"


def first_line(exc: BaseException) -> str:
    """An exception as one line: the hub's errors append the server's message and request
    id on further lines, and some transport errors have no text at all."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def hub_endpoint() -> str:
    """The hub the client talks to (``HF_ENDPOINT``, or huggingface.co)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


ANSWER_TIMEOUT = 60.0
"""Seconds the reachability check waits for an answer once connected: the hub client's own
timeout for its second try at a file's metadata (``_ETAG_RETRY_TIMEOUT``). A server that
says nothing for that long is not a slow network; the client's listing would wait for it
without end (it sets no timeout)."""

_CLIENT_ERRORS = {
    "httpx2": ("RequestError", "ConnectTimeout", "ReadTimeout"),
    "httpx": ("RequestError", "ConnectTimeout", "ReadTimeout"),
    "requests": ("ConnectionError", "ConnectTimeout", "ReadTimeout"),
}
"""Per HTTP client huggingface-hub may use (httpx2 from 2.x, httpx in 1.x, requests
before): its base class of failures to get an answer at all (no connection, a broken one,
endless redirects; not an answer with an error status), and its two timeouts (no
connection; no answer on one), by name in the module."""

ErrorTypes = tuple[type[BaseException], ...]


class NetworkErrors(NamedTuple):
    """The transport errors of the HTTP clients loaded, as ``except`` clauses take them."""

    failures: ErrorTypes
    no_connection: ErrorTypes
    no_answer: ErrorTypes


def network_errors(modules: Mapping[str, Any] | None = None) -> NetworkErrors:
    """The transport errors of the HTTP clients already imported.

    Read from ``sys.modules`` rather than imported: the hub client has loaded the one it
    uses, and naming the others must not import them. Most are not ``OSError``s, so
    without these nothing in :func:`pull` catches them.
    """
    loaded = sys.modules if modules is None else modules
    columns: list[list[type[BaseException]]] = [[], [], []]
    for client, names in _CLIENT_ERRORS.items():
        module = loaded.get(client)
        if module is not None:
            for column, name in zip(columns, names, strict=True):
                column.append(getattr(module, name))
    return NetworkErrors(*(tuple(column) for column in columns))


def hub_unreachable(connect_s: float | None = None, answer_s: float = ANSWER_TIMEOUT) -> str | None:
    """Why the hub cannot be reached, or None when it answers (any status).

    One HEAD request to the endpoint through the hub client's own session (its proxies,
    certificates and ``HF_ENDPOINT``), without the client's retries. The client retries a
    connection error 5 times with backoff (23 s) and has no setting for that; a refused
    connection, a name that does not resolve or a failed TLS handshake will not mend in
    23 s, so they fail here at once. Slow networks keep working: a connection gets
    ``connect_s`` (``HF_HUB_ETAG_TIMEOUT``, 10 s by default, what the client gives its own
    first request), then an answer gets ``answer_s``.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    errors = network_errors()
    connect = constants.HF_HUB_ETAG_TIMEOUT if connect_s is None else connect_s
    try:
        get_session().head(hub_endpoint(), timeout=(connect, answer_s))  # httpx and requests alike
    except errors.no_connection:
        return f"no connection within {connect:g} s (HF_HUB_ETAG_TIMEOUT)"
    except errors.no_answer:
        return f"no answer within {answer_s:g} s"
    except (*errors.failures, OSError) as exc:  # OSError: requests' errors, the hub's offline mode
        return first_line(exc)
    return None


@contextmanager
def _hub_errors(repo_id: str, filename: str | None, unreachable: str | None = None) -> Iterator[None]:
    """Turn what the hub client raises into one-line :class:`TandemError`s (the CLI prints
    those; anything else is a traceback). ``unreachable``: why the hub could not be
    reached, when only the cache was read."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    failures = network_errors().failures
    where = f"{repo_id}/{filename}" if filename else repo_id
    try:
        yield
    except LocalEntryNotFoundError:
        if unreachable is not None:
            raise OfflineError(
                f"{where} is not in the local cache, and "
                + unreachable_message(hub_endpoint(), unreachable)
            ) from None
        raise OfflineError(
            f"{where} is not in the local cache and the hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE is set)."
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"No repository {repo_id!r} on the Hugging Face hub (or it is private).") from None
    except EntryNotFoundError:
        raise ModelNotFound(f"{repo_id} has no file {filename!r}.") from None
    except HFValidationError:
        raise TandemError(invalid_repo_id_message(repo_id)) from None
    except failures as exc:  # after the hub client's own retries
        raise OfflineError(unreachable_message(hub_endpoint(), first_line(exc))) from None
    except OSError as exc:
        raise TandemError(f"Could not download {where}: {first_line(exc)}") from None
    except ValueError as exc:  # a file name the hub client refuses ("..", an absolute path)
        raise TandemError(f"Cannot pull {filename!r} from {repo_id}: {first_line(exc)}") from None


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
