"""``berth desk serve``: one worker process, from ``nodes.json`` to a signal.

It logs to ``$BERTH_HOME/logs/desk.log`` and to stderr (job ids, models, token counts and
errors; never a prompt or an answer), checks that the leader answers on its socket, and runs
the :class:`~berth.desk.worker.DeskWorker` until SIGINT or SIGTERM, when running jobs are
reported failed so the desk can hand them to another host.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from berth.desk.client import DeskClient
from berth.desk.leader import LeaderClient
from berth.desk.state import DeskFiles, load_key_pair, load_nodes
from berth.desk.worker import DeskWorker, WorkerTimings
from berth.errors import ConfigError
from berth.paths import BerthHome

log = logging.getLogger("berth.desk")


def configure_logging(files: DeskFiles, *, verbose: bool) -> None:
    """Send the worker's log to ``desk.log`` and stderr; httpx's per-request lines only
    when ``verbose`` (they name URLs, never bodies)."""
    files.home.logs_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(files.log_file)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)
    stream = logging.StreamHandler()
    stream.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root.addHandler(stream)
    for noisy in ("httpx", "httpcore", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


async def serve(
    home: BerthHome,
    *,
    pool_url: str,
    wait_s: int | None,
    verbose: bool,
    timings: WorkerTimings | None = None,
) -> int:
    """Run the worker for ``home`` against the desk at ``pool_url`` until a signal; 0.

    Raises :class:`ConfigError` when no model is registered or the key file is missing,
    and :class:`~berth.desk.errors.LeaderUnavailableError` when no leader answers at start.
    """
    files = DeskFiles(home)
    book = load_nodes(files)
    if not book.nodes:
        raise ConfigError("no model is registered with the desk yet; run: berth desk register")
    keys = load_key_pair(files)
    if keys is None:
        raise ConfigError(
            f"{files.key_file} is missing: sealed prompts cannot be opened without it; "
            "register again in a new home, or restore the file"
        )
    configure_logging(files, verbose=verbose)
    async with LeaderClient(home.socket_file) as leader, DeskClient(pool_url) as desk:
        await leader.served_models()  # a leader that is not running stops the start
        log.info("serving %s at %s through the leader at %s",
                 ", ".join(n.model for n in book.nodes), pool_url, home.socket_file)  # fmt: skip
        worker = DeskWorker(
            desk=desk,
            leader=leader,
            files=files,
            nodes=list(book.nodes),
            keys=keys,
            wait_s=wait_s,
            timings=timings,
        )
        task = asyncio.create_task(worker.run())
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, task.cancel)
        try:
            await asyncio.wait([task])  # a signal cancels the task, not this coroutine
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
        if not task.cancelled():
            task.result()  # the loop ends only when cancelled: anything else is a bug
    return 0
