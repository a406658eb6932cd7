"""``berth pull``: download a model repository from the Hugging Face hub.

The download itself is ``huggingface_hub.snapshot_download`` into a plain folder under the
models directory (``local_dir``), so engines read ordinary files rather than the hub's
symlinked cache.  This module only picks the folder, the endpoint and the progress display,
and turns the hub's exceptions into berth's, each with a one-line message.

The endpoint is, in order: the ``endpoint`` argument, ``$HF_ENDPOINT`` (read at call time),
``https://huggingface.co``.  Tests point it at a stand-in hub on loopback.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils.tqdm import tqdm as HubTqdm

from berth.errors import BerthError, ConfigError, NotFoundError

#: What huggingface_hub's own calls (``HfApi``) let through when no hub answers: its HTTP
#: library's transport errors (connection refused, no such host, timeouts).
#: ``snapshot_download`` wraps these in ``LocalEntryNotFoundError``; ``HfApi`` does not.
#: huggingface_hub 2 talks through httpx2, earlier releases through httpx.
HUB_TRANSPORT_ERRORS: tuple[type[Exception], ...] = (httpx.TransportError,)
try:
    import httpx2
except ImportError:  # pragma: no cover - an older huggingface_hub
    pass
else:
    HUB_TRANSPORT_ERRORS = (*HUB_TRANSPORT_ERRORS, httpx2.TransportError)

#: The public hub, used when neither an argument nor ``$HF_ENDPOINT`` names another.
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"

_SAFE_DIRNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class HubFile:
    """One file of a repository to pull: its path in the repository and its size in bytes."""

    path: str
    size_bytes: int


class PullSink(Protocol):
    """Where a pull with progress reports it. Called from the thread that downloads; any
    method may raise :class:`PullCancelled` to stop the pull there."""

    def listed(self, files: Sequence[HubFile]) -> None:
        """The repository holds ``files``; downloads start next, in this order."""

    def advanced(self, path: str, n_bytes: int) -> None:
        """``n_bytes`` more of file ``path`` arrived."""

    def finished(self, path: str) -> None:
        """File ``path`` is complete in the target folder (downloaded, or already there)."""


class PullCancelled(BerthError):
    """A :class:`PullSink` stopped the pull (its caller cancelled it)."""


def model_dirname(repo_id: str) -> str:
    """The folder name a repository is pulled into: ``org/name`` becomes ``org--name``.

    This is the hub cache's own convention, so the name stays readable and unique.
    """
    return repo_id.strip("/").replace("/", "--")


def resolve_endpoint(endpoint: str | None = None) -> str:
    """``endpoint``, else ``$HF_ENDPOINT``, else :data:`DEFAULT_HUB_ENDPOINT` (no trailing /)."""
    chosen = endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT
    return chosen.rstrip("/")


def pull_model(
    repo_id: str,
    *,
    revision: str | None = None,
    models_dir: Path,
    endpoint: str | None = None,
    token: str | None = None,
    progress: bool = True,
    dir_name: str | None = None,
    cache_dir: Path | None = None,
    sink: PullSink | None = None,
) -> Path:
    """Download every file of model repository ``repo_id`` and return the folder holding them.

    Files land in ``models_dir / dir_name`` (default :func:`model_dirname`), created if
    needed; a second pull of the same repository only fetches what changed.  ``revision`` is
    a branch, tag or commit (default: the repository's main branch); ``token`` a hub access
    token (default: ``$HF_TOKEN`` or the token saved by ``hf auth login``).  With
    ``progress`` the hub's own progress bars are drawn on stderr.  ``cache_dir`` is the
    hub cache, where huggingface_hub records branch heads and from which it copies files it
    already has (default: its own, ``$HF_HUB_CACHE``).  With ``sink`` the files are fetched
    one after the other and each file's bytes are reported to it (``progress`` is ignored);
    the sink can stop the pull by raising :class:`PullCancelled`, which is raised again.

    Blocking (it downloads): async callers run it through ``asyncio.to_thread``.

    Raises:
        ConfigError: ``repo_id`` or ``dir_name`` is malformed.
        NotFoundError: the repository (or, for a private one, access to it) or the revision
            does not exist.
        BerthError: the hub cannot be reached, refuses the request, the repository is gated,
            or the files cannot be written.
    """
    if dir_name is not None and (_SAFE_DIRNAME.match(dir_name) is None or ".." in dir_name):
        raise ConfigError(
            f"model folder name {dir_name!r} must be letters, digits, '.', '_' or '-'"
        )
    hub = resolve_endpoint(endpoint)
    target = models_dir / (dir_name or model_dirname(repo_id))
    where = repo_id if revision is None else f"{repo_id}@{revision}"
    created = not target.exists()
    try:
        return _download(repo_id, revision, target, hub, token, cache_dir, progress, where, sink)
    except BaseException:
        if created:  # a failed first pull leaves no empty or partial folder behind
            shutil.rmtree(target, ignore_errors=True)
        raise


def _download(
    repo_id: str,
    revision: str | None,
    target: Path,
    hub: str,
    token: str | None,
    cache_dir: Path | None,
    progress: bool,
    where: str,
    sink: PullSink | None,
) -> Path:
    try:
        target.mkdir(parents=True, exist_ok=True)
        if sink is not None:
            _download_reporting(repo_id, revision, target, hub, token, cache_dir, sink)
            return target.resolve()
        local = snapshot_download(
            repo_id,
            revision=revision,
            local_dir=target,
            endpoint=hub,
            token=token,
            cache_dir=cache_dir,
            tqdm_class=None if progress else _SilentProgress,
        )
    except HFValidationError as exc:
        raise ConfigError(f"invalid hub repository id {repo_id!r}: {_first_line(exc)}") from exc
    except GatedRepoError as exc:
        raise BerthError(
            f"hub repository {repo_id!r} is gated: accept its terms on the hub, "
            "then pass a token (--token or HF_TOKEN)"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise NotFoundError("hub repository", repo_id) from exc
    except RevisionNotFoundError as exc:
        raise NotFoundError("revision", where) from exc
    except LocalEntryNotFoundError as exc:
        if isinstance(exc.__cause__, OfflineModeIsEnabled):
            raise BerthError(f"cannot pull {where}: HF_HUB_OFFLINE is set") from exc
        raise BerthError(f"cannot reach the hub at {hub} to pull {where}") from exc
    except HUB_TRANSPORT_ERRORS as exc:
        raise BerthError(f"cannot reach the hub at {hub} to pull {where}") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code
        raise BerthError(f"the hub at {hub} answered HTTP {status} for {where}") from exc
    except OSError as exc:
        raise BerthError(f"cannot pull {where} into {target}: {exc.strerror or exc}") from exc
    return Path(local)


def _download_reporting(
    repo_id: str,
    revision: str | None,
    target: Path,
    hub: str,
    token: str | None,
    cache_dir: Path | None,
    sink: PullSink,
) -> None:
    """``snapshot_download``'s steps done one file at a time, so that each file's bytes can
    be reported: resolve the revision to a commit, list the files at that commit, fetch
    each (a file already in ``target`` at that commit is not fetched again)."""
    api = HfApi(endpoint=hub, token=token)
    # As snapshot_download: no revision is the main branch (the hub's default).
    commit = api.model_info(repo_id, revision=revision or "main").sha
    entries = api.list_repo_tree(repo_id, revision=commit, recursive=True)
    files = [HubFile(e.path, e.size) for e in entries if isinstance(e, RepoFile)]
    sink.listed(files)
    for file in files:
        hf_hub_download(
            repo_id,
            file.path,
            revision=commit,
            local_dir=target,
            endpoint=hub,
            token=token,
            cache_dir=cache_dir,
            tqdm_class=_reporting_bar(sink, file.path),
        )
        sink.finished(file.path)


def _reporting_bar(sink: PullSink, path: str) -> type:
    """A stand-in for the progress bar huggingface_hub draws per file, telling ``sink``
    instead (it is built as ``cls(total=..., initial=..., desc=..., ...)`` and used as a
    context manager whose ``update(n)`` counts bytes written).

    It has ``update_transfer`` like snapshot_download's own aggregating bar: then both the
    plain HTTP download and the Xet one (huggingface_hub 2.x, ``http_get`` and
    ``XetDownloadProgressReporter``) use this one bar for both counts and report network
    bytes there, which are ignored, so that no byte is counted twice.
    """

    class _Report:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.n = 0
            self.total = kwargs.get("total")
            initial = kwargs.get("initial")
            if isinstance(initial, int) and initial:
                sink.advanced(path, initial)  # a resumed download's bytes already there

        def __enter__(self) -> _Report:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            sink.advanced(path, int(n or 0))

        def update_transfer(self, n: float | None = 1) -> None:
            return None  # bytes off the network; update() counts those written

        def set_transfer_postfix_str(self, *args: object, **kwargs: object) -> None:
            return None

        def refresh(self) -> None:
            return None

        def close(self) -> None:
            return None

        def set_postfix_str(self, *args: object, **kwargs: object) -> None:
            return None

    return _Report


class _SilentProgress(HubTqdm):
    """A hub progress bar that never draws, for ``progress=False``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
