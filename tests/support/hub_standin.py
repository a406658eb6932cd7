"""A stand-in for the Hugging Face hub's HTTP API, served on loopback, for tests.

It implements just what ``huggingface_hub.snapshot_download`` asks for (as read from
huggingface_hub 2.x ``_snapshot_download.py``, ``hf_api.py`` and ``file_download.py``):

* ``GET /api/models/{repo}/revision/{rev}``: model info; ``sha`` is the resolved commit;
* ``GET /api/models/{repo}/tree/{rev}?recursive=...``: the file listing (``type``, ``path``,
  ``size``, ``oid``), in one page (no ``Link`` header);
* ``HEAD`` and ``GET /{repo}/resolve/{rev}/{path}``: the file, with ``X-Repo-Commit``,
  ``ETag`` (the git blob sha1, quoted) and ``Content-Length``.

Errors carry the ``X-Error-Code`` header the client maps to its exception classes
(``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``).  Every request is recorded in
:attr:`HubStandin.requests` as ``(method, path)``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import unquote, urlsplit

#: The files of every repository the shared ``hub`` fixture (``tests/conftest.py``) publishes:
#: a model config and a GGUF file the fake engine accepts.
TINY_FILES: dict[str, bytes] = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 8}\n',
    "tiny.gguf": b"GGUF" + bytes(range(256)) * 64,
}
#: The repositories the shared ``hub`` fixture publishes, each with :data:`TINY_FILES`: one per
#: module that pulls, so each module's pulls land in folders of their own.
TINY_REPOS = ("berth-test/tiny-model", "org/tiny", "org/tiny-remote")

_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/revision/(?P<rev>[^/]+)$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/tree/(?P<rev>[^/]+)$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob holding ``data`` (what the hub reports as ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class _Repo:
    files: dict[str, bytes]
    commit: str
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision == self.commit:
            return self.commit
        return self.branches.get(revision)


class HubStandin:
    """A tiny hub holding the repositories added with :meth:`add_repo`; a context manager."""

    def __init__(self) -> None:
        self._repos: dict[str, _Repo] = {}
        self.requests: list[tuple[str, str]] = []
        #: (repository id, file path) → an event: that file is sent half, then the rest once
        #: the event is set (to watch a download in progress); :meth:`stall` adds one.
        self.stalls: dict[tuple[str, str], threading.Event] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main") -> str:
        """Publish ``files`` as repository ``repo_id`` on ``branch``; returns the commit id."""
        listing = "".join(
            f"{name}\0{git_blob_sha1(data)}\n" for name, data in sorted(files.items())
        )
        commit = hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()
        self._repos[repo_id] = _Repo(files=dict(files), commit=commit, branches={branch: commit})
        return commit

    def stall(self, repo_id: str, path: str) -> threading.Event:
        """From now on, send file ``path`` of ``repo_id`` half, then wait for the returned
        event (at most a minute) before the rest."""
        event = self.stalls[(repo_id, path)] = threading.Event()
        return event

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: the endpoint to give huggingface_hub."""
        assert self._server is not None, "stand-in hub not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        """Listen on an ephemeral loopback port, serving from a background thread."""
        standin = self

        class Handler(_Handler):
            hub = standin

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> HubStandin:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def lookup(self, repo_id: str) -> _Repo | None:
        return self._repos.get(repo_id)


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandin

    def log_message(self, format: str, *args: object) -> None:
        """Keep test output clean: requests are recorded in ``hub.requests`` instead."""

    def do_HEAD(self) -> None:
        self._route(send_body=False)

    def do_GET(self) -> None:
        self._route(send_body=True)

    def _route(self, *, send_body: bool) -> None:
        path = urlsplit(self.path).path
        self.hub.requests.append((self.command, path))
        if match := _INFO.match(path):
            self._model_info(match["repo"], unquote(match["rev"]), send_body)
        elif match := _TREE.match(path):
            self._tree(match["repo"], unquote(match["rev"]), send_body)
        elif match := _RESOLVE.match(path):
            self._resolve(match["repo"], unquote(match["rev"]), unquote(match["path"]), send_body)
        else:
            self._error(404, "NotFound", f"no route for {path}", send_body)

    def _find(self, repo_id: str, revision: str, send_body: bool) -> tuple[_Repo, str] | None:
        repo = self.hub.lookup(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", send_body)
            return None
        commit = repo.resolve(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", "Invalid rev id: " + revision, send_body)
            return None
        return repo, commit

    def _model_info(self, repo_id: str, revision: str, send_body: bool) -> None:
        found = self._find(repo_id, revision, send_body)
        if found is None:
            return
        repo, commit = found
        info = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "siblings": [{"rfilename": name} for name in sorted(repo.files)],
        }
        self._json(info, send_body)

    def _tree(self, repo_id: str, revision: str, send_body: bool) -> None:
        found = self._find(repo_id, revision, send_body)
        if found is None:
            return
        repo, _ = found
        entries: list[dict[str, object]] = []
        folders: set[str] = set()
        for name, data in sorted(repo.files.items()):
            parts = name.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                folder = "/".join(parts[:depth])
                if folder not in folders:
                    folders.add(folder)
                    entries.append(
                        {"type": "directory", "oid": "0" * 40, "size": 0, "path": folder}
                    )
            entries.append(
                {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}
            )
        self._json(entries, send_body)

    def _resolve(self, repo_id: str, revision: str, path: str, send_body: bool) -> None:
        found = self._find(repo_id, revision, send_body)
        if found is None:
            return
        repo, commit = found
        data = repo.files.get(path)
        if data is None:
            self._error(404, "EntryNotFound", f"{path} does not exist", send_body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{git_blob_sha1(data)}"')
        self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if not send_body:
            return
        stall = self.hub.stalls.get((repo_id, path))
        if stall is None:
            self.wfile.write(data)
            return
        half = len(data) // 2
        self.wfile.write(data[:half])
        self.wfile.flush()
        stall.wait(60)
        self.wfile.write(data[half:])

    def _json(self, payload: object, send_body: bool) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, send_body: bool) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.end_headers()
        if send_body:
            self.wfile.write(body)
