"""Pull jobs on the leader: download a hub repository into the models folder, then register
it (``/admin/pulls``).

Each job downloads in a worker thread (:func:`berth.runtime.hf_pull.pull_model` with a
:class:`~berth.runtime.hf_pull.PullSink`), so the event loop never waits on the hub; the sink
counts each file's bytes under a lock, and the API reads a copy. At most
``max_parallel`` jobs download at once, the rest are ``queued``. Cancelling sets an event the
sink checks on every chunk, so a download stops within one chunk (a first pull's partial
folder is removed by ``pull_model``); a leader that stops cancels its jobs' tasks, which
cancels their downloads the same way. Jobs live in memory only: a restarted leader has none,
and only the newest ``keep_finished`` finished ones are kept.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from berth.api.pulls import FINISHED_PULL_STATES, Pull, PullFile, PullIn, PullState
from berth.errors import BerthError, ConflictError, NotFoundError
from berth.runtime.hf_pull import HubFile, PullCancelled, pull_model

log = logging.getLogger(__name__)

#: Registers what a job downloaded (the pull's body, the folder): returns what it became.
Register = Callable[[PullIn, Path], Awaitable[Literal["model", "adapter"]]]
#: The names models and adapters have now (a pull may not take one).
TakenNames = Callable[[], Awaitable[set[str]]]
#: Jobs downloading at once.
DEFAULT_MAX_PARALLEL = 2
#: Finished jobs kept for ``GET /admin/pulls``.
DEFAULT_KEEP_FINISHED = 50


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class _FileCount:
    size_bytes: int
    done_bytes: int = 0


@dataclass
class _Job:
    id: str
    body: PullIn
    created_at: datetime
    state: PullState = "queued"
    error: str | None = None
    files: dict[str, _FileCount] = field(default_factory=dict)
    listed: bool = False
    kind: Literal["model", "adapter"] | None = None
    path: str | None = None
    finished_at: datetime | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    task: asyncio.Task[None] | None = None

    def view(self) -> Pull:
        with self.lock:
            files = [
                PullFile(path=p, size_bytes=c.size_bytes, done_bytes=c.done_bytes)
                for p, c in self.files.items()
            ]
            state, error = self.state, self.error
        return Pull(
            id=self.id,
            repo=self.body.repo,
            name=self.body.registered_name,
            revision=self.body.revision,
            base=self.body.base,
            state=state,
            error=error,
            done_bytes=sum(f.done_bytes for f in files),
            total_bytes=sum(f.size_bytes for f in files) if self.listed else None,
            files=files,
            kind=self.kind,
            path=self.path,
            created_at=self.created_at,
            finished_at=self.finished_at,
        )

    def finish(self, state: PullState, error: str | None = None) -> None:
        with self.lock:
            self.state = state
            self.error = error
            self.finished_at = _now()


class _JobSink:
    """The job's :class:`~berth.runtime.hf_pull.PullSink`; called from the download thread."""

    def __init__(self, job: _Job) -> None:
        self._job = job

    def _check(self) -> None:
        if self._job.cancel.is_set():
            raise PullCancelled(f"the pull of {self._job.body.repo} was cancelled")

    def listed(self, files: Sequence[HubFile]) -> None:
        self._check()
        with self._job.lock:
            self._job.files = {f.path: _FileCount(f.size_bytes) for f in files}
            self._job.listed = True

    def advanced(self, path: str, n_bytes: int) -> None:
        self._check()
        with self._job.lock:
            count = self._job.files.get(path)
            if count is not None:
                count.done_bytes = max(0, min(count.size_bytes, count.done_bytes + n_bytes))

    def finished(self, path: str) -> None:
        with self._job.lock:
            count = self._job.files.get(path)
            if count is not None:
                count.done_bytes = count.size_bytes
        self._check()


class PullJobs:
    """The leader's pull jobs.

    ``models_dir`` is where repositories land (one folder each, named as ``berth pull``
    names them); ``register`` and ``taken`` come from the daemon's model and adapter
    registries; ``endpoint`` and ``cache_dir`` are passed to ``pull_model`` (``None``: the
    hub of ``$HF_ENDPOINT`` and huggingface_hub's own cache).
    """

    def __init__(
        self,
        *,
        models_dir: Path,
        register: Register,
        taken: TakenNames,
        endpoint: str | None = None,
        cache_dir: Path | None = None,
        max_parallel: int = DEFAULT_MAX_PARALLEL,
        keep_finished: int = DEFAULT_KEEP_FINISHED,
    ) -> None:
        self._models_dir = models_dir
        self._register = register
        self._taken = taken
        self._endpoint = endpoint
        self._cache_dir = cache_dir
        self._slots = asyncio.Semaphore(max_parallel)
        self._keep_finished = keep_finished
        self._jobs: dict[str, _Job] = {}
        self._seq = itertools.count(1)

    async def start(self, body: PullIn) -> Pull:
        """Queue a pull of ``body`` and return it (state ``queued``).

        Raises ``ConflictError`` when a model or adapter has its name already, or a job not
        finished pulls the same name or the same repository.
        """
        name = body.registered_name
        if name in await self._taken():
            raise ConflictError(f"a model or adapter named {name!r} already exists")
        # No await from here to the job's insertion: two starts cannot both pass the check.
        for job in self._jobs.values():
            if job.view().state in FINISHED_PULL_STATES:
                continue
            if job.body.registered_name == name:
                raise ConflictError(f"pull {job.id} is already pulling {name!r}")
            if job.body.repo == body.repo:
                raise ConflictError(f"pull {job.id} is already pulling {body.repo}")
        job = _Job(
            id=f"pull-{next(self._seq)}-{secrets.token_hex(3)}", body=body, created_at=_now()
        )
        self._jobs[job.id] = job
        self._forget_old()
        job.task = asyncio.create_task(self._run(job), name=f"berth-{job.id}")
        return job.view()

    def list(self) -> list[Pull]:
        """Every job kept, oldest first."""
        return [job.view() for job in self._jobs.values()]

    def get(self, pull_id: str) -> Pull:
        """The job ``pull_id``; ``NotFoundError`` when there is none (or it was forgotten)."""
        return self._job(pull_id).view()

    async def cancel(self, pull_id: str) -> Pull:
        """Stop the job ``pull_id`` (unless it finished) and forget it: its last view is
        returned (``cancelled`` once stopped), and it is no longer listed or found at its
        address, as a deleted resource is not. Raises ``NotFoundError``."""
        job = self._job(pull_id)
        if job.view().state not in FINISHED_PULL_STATES:
            job.cancel.set()
            if job.task is not None:
                if job.view().state == "queued":
                    job.task.cancel()  # it waits for a download slot: nothing to stop
                await asyncio.wait([job.task])
        self._jobs.pop(pull_id, None)
        return job.view()

    def _job(self, pull_id: str) -> _Job:
        job = self._jobs.get(pull_id)
        if job is None:
            raise NotFoundError("pull", pull_id)
        return job

    def _forget_old(self) -> None:
        finished = [j for j in self._jobs.values() if j.view().state in FINISHED_PULL_STATES]
        for job in finished[: max(0, len(finished) - self._keep_finished)]:
            del self._jobs[job.id]

    async def _run(self, job: _Job) -> None:
        try:
            async with self._slots:
                await self._pull(job)
        except asyncio.CancelledError:
            asked = job.cancel.is_set()
            job.cancel.set()  # a download thread stops at its next chunk
            job.finish("cancelled", None if asked else "the leader stopped")
            raise
        except Exception as exc:  # a job's bug must not pass silently: it fails, logged
            log.exception("pull %s of %s failed unexpectedly", job.id, job.body.repo)
            job.finish("failed", f"internal error: {exc}")

    async def _pull(self, job: _Job) -> None:
        body = job.body
        if job.cancel.is_set():
            job.finish("cancelled")
            return
        with job.lock:
            job.state = "downloading"
        try:
            folder = await asyncio.to_thread(
                pull_model,
                body.repo,
                revision=body.revision,
                models_dir=self._models_dir,
                endpoint=self._endpoint,
                cache_dir=self._cache_dir,
                sink=_JobSink(job),
            )
        except PullCancelled:
            job.finish("cancelled")
            return
        except BerthError as exc:
            job.finish("failed", str(exc))
            return
        job.path = str(folder)
        with job.lock:
            job.state = "registering"
        try:
            job.kind = await self._register(body, folder)
        except BerthError as exc:
            job.finish("failed", f"downloaded into {folder}, but not registered: {exc}")
            return
        job.finish("done")
