"""Pulling a GGUF model from the Hugging Face hub into its cache, which the store lists.

The only code in Tandem that touches the network, and only when the user asks to pull:
``HF_HUB_OFFLINE`` is honoured, a hub that cannot be reached fails in one line instead of
the hub client's retries, and a file already cached still serves offline.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from tandem.errors import ModelFormatError, ModelNotFound, OfflineError, TandemError
from tandem.models.gguf_file import inspect_gguf


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


REPO_ID_EXAMPLE = "ggml-org/models"
"""What a repository id looks like, named in the error for one that is not."""

OFFLINE_HINT = "check the network, or set HF_HUB_OFFLINE=1 to use only what is cached"
"""What to do when the hub cannot be reached, said after why."""


@dataclass(frozen=True)
class HubReference:
    """A model named on the hub: its repository, and the file or quantization tag asked for."""

    repo_id: str
    filename: str | None = None
    tag: str | None = None
    """A quantization such as ``Q4_K_M`` (``owner/name:Q4_K_M``): the file whose name holds it."""
    revision: str | None = None
    """A branch, tag or commit from a file's URL (``.../blob/REV/FILE``); None: the default branch."""


HUB_HOSTS = ("huggingface.co/", "hf.co/")
"""Prefixes a reference may carry, after an optional ``https://`` (Ollama writes ``hf.co/``)."""

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def parse_reference(text: str, filename: str | None = None) -> HubReference:
    """``text`` as the other local-model tools write it: ``owner/name``, with a
    quantization tag as llama.cpp's ``-hf`` and Ollama take it (``owner/name:Q4_K_M``),
    with or without ``hf.co/`` or ``https://huggingface.co/`` in front, or the address of
    a file on the hub (``.../blob/main/FILE.gguf``, ``.../resolve/main/FILE.gguf``).
    ``filename``: the file named on its own (``tandem pull REPO FILE``); it must agree
    with one the reference names."""
    ref = re.sub(r"^https?://", "", text.strip())
    for host in HUB_HOSTS:
        if ref.startswith(host):
            ref = ref[len(host):]
            break
    parts = ref.split("/")
    named, revision = None, None
    if len(parts) > 4 and parts[2] in ("blob", "resolve"):
        named, revision = "/".join(parts[4:]).split("?")[0], parts[3]
        parts = parts[:2]
    elif len(parts) > 2 and parts[2] in ("tree", ""):  # a repository's file list, or a trailing /
        parts = parts[:2]
    repo, _, tag = "/".join(parts).partition(":")
    if tag and not _TAG.fullmatch(tag):
        raise TandemError(f"{tag!r} is not a quantization tag (e.g. Q4_K_M) in {text!r}")
    if named and filename and named != filename:
        raise TandemError(f"{text!r} names the file {named!r} and the command names {filename!r}: give one")
    if tag and (named or filename):
        raise TandemError(f"{text!r} asks for the tag {tag!r} and a file is named too: give one")
    if named is not None and revision == "main":
        revision = None
    check_repo_id(repo)
    return HubReference(repo, named or filename, tag or None, revision)


DEFAULT_TAG = "Q4_K_M"
"""The quantization taken from a repository of several when none is asked for, as
llama.cpp's ``-hf`` and Ollama do: the usual balance of size and quality."""


def has_tag(filename: str, tag: str) -> bool:
    """Whether ``filename`` holds the quantization ``tag`` as a whole word, in any case:
    ``Q4_K_M`` matches ``model-q4_k_m.gguf`` but not ``model-Q4_K_M_L.gguf``, and ``Q4_XS``
    not ``model-IQ4_XS.gguf``."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", Path(filename).name, re.IGNORECASE) is not None


def pick_gguf(repo_id: str, files: list[str], tag: str | None) -> tuple[str, str | None]:
    """The GGUF file to pull from ``files`` (a repository's, or those cached of it) and,
    when it was not the only choice, why it was taken: the one with ``tag``; with no tag,
    the only model file, else the :data:`DEFAULT_TAG` one. Vision projectors
    (``mmproj-*``) are not models and are never taken. Anything else is for the user to
    choose, so the error lists the files."""
    models = [f for f in files if f.endswith(".gguf") and not Path(f).name.lower().startswith("mmproj")]
    if tag is not None:
        chosen = [f for f in models if has_tag(f, tag)]
        why = None
    elif len(models) == 1:
        chosen, why = models, None
    else:
        chosen = [f for f in models if has_tag(f, DEFAULT_TAG)]
        why = f"{repo_id} holds {len(models)} GGUF files: took the {DEFAULT_TAG} one, as llama.cpp and Ollama do " \
              f"(ask for another as {repo_id}:TAG)"
    if len(chosen) == 1:
        return chosen[0], why
    if chosen and all(_SPLIT.search(f) for f in chosen):
        raise TandemError(f"{repo_id}: {chosen[0]} is split into {len(chosen)} files, which Tandem does not load; "
                          "pick a single-file GGUF")
    wanted = f"GGUF files with the tag {tag!r}" if tag else "GGUF model files"
    listing = "\n  ".join(chosen or models) or "(no .gguf files)"
    hint = f"pick one with {repo_id}:TAG or by its name" if (chosen or models) else "this repository has no model to pull"
    raise TandemError(f"{repo_id} holds {len(chosen)} {wanted}; {hint}:\n  {listing}")


_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
"""The name of one part of a GGUF split by llama.cpp's ``gguf-split``."""


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
    revision: str | None = None
    chosen: str | None = None
    """Why this file was taken when the user named none and it was not the only one."""


def _silent(stage: str) -> None:
    """The default ``notify``: a pull from code reports no stages."""


def pull(reference: str, filename: str | None = None) -> Path:
    """Download a GGUF file from the Hugging Face hub (or find it in the cache offline).

    ``reference``: a repository, maybe with a tag or as a file's address
    (:func:`parse_reference`). Without a file named, :func:`pick_gguf` chooses, or the
    error lists the choices. Every failure is a :class:`TandemError` of one line.
    """
    return download(prepare_pull(reference, filename))


def prepare_pull(reference: str, filename: str | None = None, *,
                 notify: Callable[[str], None] = _silent) -> PullSource:
    """Read ``reference``, reach the hub (unless offline) and pick the file to download.

    ``notify`` hears each stage that may take a while ("reaching …", "listing …"). A hub
    that cannot be reached (or ``HF_HUB_OFFLINE``) leaves the local cache: a file named,
    or one of the repository's files already cached, still serves, as the hub client
    itself would do.
    """
    ref = parse_reference(reference, filename)
    why = None
    if not offline():
        endpoint = hub_endpoint()
        notify(f"reaching {endpoint}")
        why = hub_unreachable()
    if offline() or why is not None:
        if ref.filename is not None:
            return PullSource(ref.repo_id, ref.filename, unreachable=why, revision=ref.revision)
        cached = cached_files(ref.repo_id)
        if not cached:
            if why is not None:
                raise OfflineError(unreachable_message(hub_endpoint(), why))
            raise OfflineError(
                f"Offline (HF_HUB_OFFLINE is set) and nothing of {ref.repo_id} is cached: name the file to pull, "
                "or unset HF_HUB_OFFLINE to list the repository."
            )
        name, chosen = pick_gguf(ref.repo_id, cached, ref.tag)
        return PullSource(ref.repo_id, name, unreachable=why, chosen=chosen)
    if ref.filename is not None:
        return PullSource(ref.repo_id, ref.filename, revision=ref.revision)
    notify(f"listing {ref.repo_id}")
    # local: the hub client only when downloads are asked about
    from huggingface_hub import list_repo_files

    with _hub_errors(ref.repo_id, None):
        files = list_repo_files(ref.repo_id)
    name, chosen = pick_gguf(ref.repo_id, files, ref.tag)
    return PullSource(ref.repo_id, name, chosen=chosen)


@dataclass(frozen=True)
class CachedFile:
    """One file of one revision in the local hub cache."""

    repo_id: str
    repo_type: str
    """``model``, ``dataset`` or ``space``."""
    name: str
    """Its path in the repository."""
    path: Path
    """Where it is in the cache (the revision's snapshot link)."""


def cached_hub_files() -> list[CachedFile]:
    """Every file in the local hub cache, of every repository and revision: what the store
    lists and what a pull without the network can still choose from. Read from disk only."""
    try:
        from huggingface_hub import constants, scan_cache_dir
        from huggingface_hub.errors import CacheNotFound
    except ImportError:  # pragma: no cover - huggingface-hub is a dependency
        return []
    try:
        info = scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:
        return []
    return [CachedFile(repo.repo_id, repo.repo_type, Path(f.file_path).relative_to(rev.snapshot_path).as_posix(),
                       Path(f.file_path))
            for repo in info.repos for rev in repo.revisions for f in rev.files]


def cached_files(repo_id: str) -> list[str]:
    """The files of the model repository ``repo_id`` in the local hub cache (every
    revision), by their path in the repository."""
    return sorted({f.name for f in cached_hub_files() if f.repo_id == repo_id and f.repo_type == "model"})


def download(source: PullSource) -> Path:
    """The file ``source`` names, from the hub or, offline or when the hub cannot be
    reached, from the local cache; checked to be a GGUF file when it is named like one."""
    # local: the hub client only when downloads are asked about
    from huggingface_hub import hf_hub_download

    local_only = offline() or source.unreachable is not None
    with _hub_errors(source.repo_id, source.filename, source.unreachable):
        path = Path(hf_hub_download(source.repo_id, source.filename, revision=source.revision,
                                    local_files_only=local_only))
    if source.filename.endswith(".gguf"):
        try:
            inspect_gguf(path)
        except ModelFormatError as exc:
            raise ModelFormatError(f"Downloaded file is not a valid GGUF: {exc}") from None
    return path


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
