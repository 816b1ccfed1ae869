"""`tandem pull` against hubs that cannot be reached, and against a tiny local one.

Every failure must be one `tandem: error:` line and a non-zero exit, never a traceback or
the hub client's 23 s of "Retrying…". The hub is pointed (``HF_ENDPOINT``) at a closed
local port, a socket that never accepts, or a fake hub served from this process: nothing
here touches the real network.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tandem.errors import OfflineError, TandemError
from tandem.models.hub import first_line, invalid_repo_id_message, network_errors

BOUND_S = 60
"""Far above the ~0.5 s a refused connection now takes on a loaded 2-core box, far below
the hub client's own 23 s of retries plus a start-up: the point is the message."""

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def pull_cli(home: Path, endpoint: str, *args: str, offline: bool = False,
             extra_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """``tandem pull ARGS`` in a child with its own TANDEM_HOME and HF_HOME, the hub at
    ``endpoint``, online unless ``offline``; the result and its seconds."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_HOME")}
    env.update(TANDEM_HOME=str(home / "tandem"), HF_HOME=str(home / "hf"), HF_ENDPOINT=endpoint)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    env.update(extra_env or {})
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tandem.app.cli", "pull", *args],
                          capture_output=True, text=True, timeout=BOUND_S * 3, env=env)
    return done, time.monotonic() - start


def assert_one_error_line(done: subprocess.CompletedProcess, exit_code: int, *needles: str) -> str:
    """The run failed with ``exit_code`` and said so in one line that holds ``needles``."""
    assert "Traceback" not in done.stderr and "Retrying" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: error: "), done.stderr
    assert done.returncode == exit_code, (done.returncode, done.stderr)
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def closed_port() -> str:
    """An endpoint on a local port nothing listens on: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class FakeHub(ThreadingHTTPServer):
    """Just enough of the hub for one repository: the listing, a file's metadata, its bytes."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), _FakeHubHandler)
        self.files = files
        self.requests: list[str] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FakeHubHandler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        self.server.requests.append(f"{self.command} {self.path}")
        path = self.path.split("?")[0]
        files = self.server.files
        if path == "/":
            return self._send(200, b"", {})
        if path.endswith("/tree/main"):
            listing = [{"type": "file", "path": name, "size": len(data), "oid": "0" * 40}
                       for name, data in files.items()]
            return self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"}, body)
        name = path.rpartition("/resolve/main/")[2]
        if name in files:
            etag = hashlib.sha256(files[name]).hexdigest()
            return self._send(200, files[name], {"ETag": f'"{etag}"', "X-Repo-Commit": COMMIT}, body)
        self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}, body)

    def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool = True) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture()
def fake_hub(stories260k: Path) -> Iterator[FakeHub]:
    hub = FakeHub({"stories260K.gguf": stories260k.read_bytes(), "README.md": b"# stories\n"})
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    yield hub
    hub.shutdown()
    hub.server_close()


def test_unreachable_hub_without_a_file_is_one_line(tmp_path: Path, closed_port: str) -> None:
    done, seconds = pull_cli(tmp_path, closed_port, "not/a-real-repo-xyz")
    assert_one_error_line(done, OfflineError.exit_code, "cannot reach the Hugging Face hub",
                          closed_port, "HF_HUB_OFFLINE=1")
    assert seconds < BOUND_S


def test_unreachable_hub_with_a_file_is_one_line(tmp_path: Path, closed_port: str) -> None:
    done, seconds = pull_cli(tmp_path, closed_port, "not/a-real-repo-xyz", "x.gguf")
    assert_one_error_line(done, OfflineError.exit_code, "not in the local cache",
                          "cannot reach the Hugging Face hub", "HF_HUB_OFFLINE=1")
    assert seconds < BOUND_S


def test_a_hub_that_never_accepts_is_one_line(tmp_path: Path) -> None:
    """A listening socket whose backlog is full drops new connections, like a firewall:
    the check gives up after HF_HUB_ETAG_TIMEOUT instead of the client retrying."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        try:
            done, seconds = pull_cli(tmp_path, f"http://127.0.0.1:{port}", "some/repo",
                                     extra_env={"HF_HUB_ETAG_TIMEOUT": "2"})
        finally:
            for filler in fillers:
                filler.close()
    assert_one_error_line(done, OfflineError.exit_code, "cannot reach the Hugging Face hub")
    assert seconds < BOUND_S


def test_bad_repo_id_is_one_line(tmp_path: Path, closed_port: str) -> None:
    done, _ = pull_cli(tmp_path, closed_port, "bad repo name!!", "x.gguf")
    assert_one_error_line(done, TandemError.exit_code, "'bad repo name!!'",
                          "not a valid Hugging Face repository id", "owner/name")
    offline, _ = pull_cli(tmp_path, closed_port, "a/b/c", offline=True)  # checked offline too
    assert_one_error_line(offline, TandemError.exit_code, "not a valid Hugging Face repository id")


def test_offline_pull_is_unchanged_and_never_connects(tmp_path: Path, fake_hub: FakeHub) -> None:
    named, _ = pull_cli(tmp_path, fake_hub.endpoint, "tandem-test/stories", "stories260K.gguf", offline=True)
    assert_one_error_line(named, OfflineError.exit_code, "not in the local cache",
                          "(offline, or HF_HUB_OFFLINE is set)")
    unnamed, _ = pull_cli(tmp_path, fake_hub.endpoint, "tandem-test/stories", offline=True)
    assert_one_error_line(unnamed, OfflineError.exit_code, "name the file to pull")
    assert fake_hub.requests == []


def test_pull_from_a_reachable_hub_then_from_the_cache_once_it_is_gone(tmp_path: Path, fake_hub: FakeHub) -> None:
    """The reachability check lets a working hub through (the one GGUF file is picked and
    downloaded); once the hub is gone, the named file still comes from the cache, and
    offline too."""
    done, _ = pull_cli(tmp_path, fake_hub.endpoint, "tandem-test/stories")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "tandem-test/stories/stories260K.gguf is ready" in done.stdout
    assert any(r.startswith("GET /api/models/tandem-test/stories/tree/main") for r in fake_hub.requests)
    endpoint = fake_hub.endpoint
    fake_hub.shutdown()
    fake_hub.server_close()

    cached, _ = pull_cli(tmp_path, endpoint, "tandem-test/stories", "stories260K.gguf")
    assert cached.returncode == 0 and "is ready" in cached.stdout, cached.stderr
    assert "Traceback" not in cached.stderr and "using the cached copy" in cached.stderr
    offline, _ = pull_cli(tmp_path, endpoint, "tandem-test/stories", "stories260K.gguf", offline=True)
    assert offline.returncode == 0 and offline.stderr == "", offline.stderr
    missing, _ = pull_cli(tmp_path, endpoint, "tandem-test/stories", "other.gguf")
    assert_one_error_line(missing, OfflineError.exit_code, "not in the local cache", "cannot reach")


def test_a_missing_file_on_a_reachable_hub_is_one_line(tmp_path: Path, fake_hub: FakeHub) -> None:
    done, _ = pull_cli(tmp_path, fake_hub.endpoint, "tandem-test/stories", "nope.gguf")
    assert_one_error_line(done, 2, "has no file 'nope.gguf'")


def test_first_line_and_network_errors_are_pure() -> None:
    assert first_line(OSError("Client error '500'\nRequest id: abc")) == "Client error '500'"
    assert first_line(TimeoutError()) == "TimeoutError"
    assert network_errors({}) == ((), (), ())

    class Fake:
        RequestError, ConnectTimeout, ReadTimeout = OSError, TimeoutError, ConnectionError

    errors = network_errors({"httpx2": Fake})
    assert errors.failures == (OSError,) and errors.no_connection == (TimeoutError,)
    assert errors.no_answer == (ConnectionError,)
    assert "\n" not in invalid_repo_id_message("a\nb") and "owner/name" in invalid_repo_id_message("x y")


def test_pull_by_tag_and_address_as_llama_cpp_and_ollama_users_write_it(tmp_path: Path, stories260k: Path) -> None:
    """A repository of several quantizations: a tag takes its file, no tag takes the
    Q4_K_M one and says so, a file's hub address takes that file, and once the hub is
    gone the same tag still finds its file in the cache."""
    data = stories260k.read_bytes()
    hub = FakeHub({"stories-Q4_K_M.gguf": data, "stories-Q8_0.gguf": data, "stories-IQ4_XS.gguf": data,
                   "mmproj-stories-f16.gguf": data})
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        tagged, _ = pull_cli(tmp_path, hub.endpoint, "hf.co/tandem-test/quants:q8_0")
        assert tagged.returncode == 0 and "tandem-test/quants/stories-Q8_0.gguf is ready" in tagged.stdout, tagged.stderr
        default, _ = pull_cli(tmp_path, hub.endpoint, "tandem-test/quants")
        assert default.returncode == 0 and "stories-Q4_K_M.gguf is ready" in default.stdout, default.stderr
        assert "took the Q4_K_M one" in default.stderr and "Traceback" not in default.stderr
        address, _ = pull_cli(tmp_path, hub.endpoint,
                              "https://huggingface.co/tandem-test/quants/blob/main/stories-IQ4_XS.gguf")
        assert address.returncode == 0 and "stories-IQ4_XS.gguf is ready" in address.stdout, address.stderr
        missing, _ = pull_cli(tmp_path, hub.endpoint, "tandem-test/quants:Q2_K")
        assert missing.returncode == TandemError.exit_code and "Traceback" not in missing.stderr
        first, *listed = missing.stderr.strip().splitlines()  # the choices, one a line
        assert first.startswith("tandem: error: ") and "holds 0 GGUF files with the tag 'Q2_K'" in first
        assert sorted(line.strip() for line in listed) == ["stories-IQ4_XS.gguf", "stories-Q4_K_M.gguf",
                                                          "stories-Q8_0.gguf"]
    finally:
        hub.shutdown()
        hub.server_close()
    offline, _ = pull_cli(tmp_path, hub.endpoint, "tandem-test/quants:Q8_0", offline=True)
    assert offline.returncode == 0 and "stories-Q8_0.gguf is ready" in offline.stdout, offline.stderr
    assert not any("mmproj" in r for r in hub.requests)
