"""Event-loop lag: how late the loop runs a timer, and which callback held it up.

The leader and the agent each run everything on one event loop (uvloop), so one callback
that blocks, a TLS context built on the loop or a synchronous file write, delays every request
and stream of that process by as long as it runs. :class:`LoopLagMonitor` makes that visible
cheaply enough to stay on in production:

- **On the loop**, a timer fires every ``interval_s`` (20 ms) and records how late it ran in a
  histogram (:data:`LAG_BUCKETS_S`, 1 ms to 1 s). That is one small callback per interval,
  with no per-callback instrumentation: asyncio's debug mode (``slow_callback_duration``)
  wraps every callback and does not exist on uvloop at all.
- **On a watchdog thread**, which sleeps until the next tick is overdue by ``threshold_s``
  (50 ms). When it wakes and the tick has still not run, the loop thread is stuck in
  something: the watchdog takes one sample of that thread's Python stack
  (``sys._current_frames()``) and keeps it. When the late tick finally runs, it logs one
  warning for the stall with its length, the callback that was running (the outermost frame
  above the loop), the task, and a short stack, innermost last. A stall still going on after
  ``hang_warning_s`` is also logged by the watchdog itself, in case the loop never returns.

Limits worth knowing when reading a warning: the sample is taken once, about ``threshold_s``
into the stall, so it shows where the callback was then, not necessarily the line that took
longest; a C function that holds the GIL (loading a CA bundle) delays the sample until it
returns, so the sample lands just after it; code with no Python frame (uvloop's own TLS
code, a process the kernel did not schedule) shows as "no Python callback"; and a thread
holding the GIL for long makes the loop thread wait at whatever line it had reached.

A warning also says when a full garbage collection (generation 2) ran within the stall: it
holds the GIL while it traverses the heap, so the sampled line is only where it began
(``berth.eventloop.freeze_startup_objects`` keeps those collections short). Warnings from the
same callback are limited to one per ``warn_interval_s``; the next one says how many stalls
were left out meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import sys
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass
from types import CodeType, FrameType

log = logging.getLogger(__name__)

#: Upper bounds (seconds) of the lag histogram's buckets: 1 ms (timer noise) to 1 s.
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: Seconds between two ticks of the loop's timer.
TICK_INTERVAL_S = 0.02
#: A tick this many seconds late means a callback blocked the loop: it is sampled and logged.
STALL_THRESHOLD_S = 0.05
#: A stall still going on after this many seconds is logged while it lasts.
HANG_WARNING_S = 2.0
#: Most warnings per second for stalls in the same callback.
WARN_INTERVAL_S = 1.0
#: Frames shown in a warning's stack (the innermost ones; the callback's frame is kept too).
STACK_FRAMES = 12


@dataclass(frozen=True)
class LagHistogram:
    """Lag observations since the monitor started: per-bucket counts (not cumulative) for
    ``bounds_s`` plus one last bucket above the largest bound, and their sum in seconds."""

    bounds_s: tuple[float, ...]
    counts: tuple[int, ...]
    sum_s: float

    @property
    def count(self) -> int:
        """All observations."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs as the Prometheus text format writes them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds_s, None), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound is None else repr(float(bound)), float(running)))
        return out


def empty_histogram(bounds_s: tuple[float, ...] = LAG_BUCKETS_S) -> LagHistogram:
    """A histogram with no observations."""
    return LagHistogram(bounds_s, (0,) * (len(bounds_s) + 1), 0.0)


@dataclass(frozen=True)
class FrameLine:
    """One frame of a sampled stack: the function's qualified name, its file and line."""

    function: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({self.path}:{self.line})"


@dataclass(frozen=True)
class StackSample:
    """What the loop thread was running, sampled during a stall.

    ``frames`` run from the callback (outermost, just above the event loop) to the innermost
    frame; empty when no Python callback was running. ``task`` is the name of the asyncio task
    being stepped, if one was; ``at_s`` is how far into the stall the sample was taken.
    """

    frames: tuple[FrameLine, ...]
    task: str | None
    at_s: float

    @property
    def callback(self) -> FrameLine | None:
        """The callback's own frame: the outermost one that is not asyncio's machinery (a
        pure-Python task step runs the coroutine from inside ``asyncio/tasks.py``)."""
        for frame in self.frames:
            if not frame.path.startswith("asyncio/"):
                return frame
        return self.frames[0] if self.frames else None


def short_path(filename: str) -> str:
    """``filename`` without the part that only says where Python or the checkout is:
    ``.../site-packages/httpx/_client.py`` -> ``httpx/_client.py``,
    ``.../src/berth/deployments/reconcile.py`` -> ``berth/deployments/reconcile.py``,
    ``/usr/lib/python3.11/ssl.py`` -> ``ssl.py``."""
    for marker in ("/site-packages/", "/dist-packages/", "/src/"):
        _head, found, tail = filename.rpartition(marker)
        if found:
            return tail
    stdlib = os.path.dirname(os.__file__) + os.sep
    if filename.startswith(stdlib):
        return filename[len(stdlib) :]
    return filename


def callback_frames(frame: FrameType | None, base: CodeType | None) -> tuple[FrameLine, ...]:
    """The frames from ``frame`` outwards up to (not including) the first one running
    ``base``, the loop's own frame that calls callbacks; outermost first.

    Empty when ``base`` is not on the stack (the loop was idle in its poller) or when
    ``frame`` is ``base`` itself (no Python callback running). With ``base`` unknown
    (``None``) the whole stack is returned.
    """
    lines: list[FrameLine] = []
    while frame is not None:
        code = frame.f_code
        if code is base:
            break
        lines.append(FrameLine(code.co_qualname, short_path(code.co_filename), frame.f_lineno or 0))
        frame = frame.f_back
    else:
        if base is not None:
            return ()
    lines.reverse()
    return tuple(lines)


def describe_stall(
    blocked_s: float,
    sample: StackSample | None,
    *,
    left_out: int = 0,
    ongoing: bool = False,
    full_gc: bool = False,
    threshold_s: float = STALL_THRESHOLD_S,
) -> str:
    """The warning's text for a stall of ``blocked_s`` seconds (``sample`` as taken, if any);
    ``ongoing`` for one that has not ended yet, ``full_gc`` when a full garbage collection ran
    within it; ``threshold_s`` is the monitor's."""
    if ongoing:
        text = f"event loop has been blocked for {blocked_s:.1f} s and still is"
    else:
        text = f"event loop blocked for {blocked_s * 1000:.1f} ms"
    if full_gc:
        text += " during a full garbage collection (generation 2)"
    if sample is None:
        text += " (not sampled: it ended before the watchdog looked)"
    elif not sample.frames:
        text += (
            " with no Python callback running (loop internals in C such as uvloop's TLS, "
            "the garbage collector, or the process did not get a CPU)"
        )
    else:
        callback = sample.callback
        text += f" by {callback}"
        if sample.task:
            text += f" in task {sample.task!r}"
        inner = sample.frames[-1]
        if inner is not callback:
            text += f", at {inner}"
        text += f"; stack sampled {sample.at_s * 1000:.0f} ms in"
        if sample.at_s > 2 * threshold_s and sample.at_s > 0.8 * blocked_s:
            # The watchdog woke this late: it was held up too, so the whole process was
            # waiting (for a CPU, or for the GIL held by another thread), not only the loop.
            text += " (the watchdog was held up too: the process waited for a CPU or the GIL)"
        text += ", innermost last:"
        shown = list(sample.frames)
        if len(shown) > STACK_FRAMES:
            shown = [shown[0], *shown[-(STACK_FRAMES - 1) :]]
            text += f"\n  {shown[0]}\n  ..."
            shown = shown[1:]
        for frame in shown:
            text += f"\n  {frame}"
    if left_out:
        text += f"\n  ({left_out} more stalls of this callback since the last warning)"
    return text


class LoopLagMonitor:
    """Measures the running loop's lag and names the callbacks that stall it.

    Call :meth:`start` on the loop to watch and :meth:`stop` (on the same loop) to end; read
    :meth:`histogram` at any time from the loop's thread. ``interval_s`` is the tick period,
    ``threshold_s`` the lag from which a stall is sampled and logged, ``hang_warning_s`` how
    long a stall may last before the watchdog logs it while it goes on, and
    ``warn_interval_s`` the least time between two warnings naming the same callback; all in
    seconds. Raises ``ValueError`` when one is not positive, or when ``buckets_s`` is empty
    or not increasing.
    """

    def __init__(
        self,
        *,
        interval_s: float = TICK_INTERVAL_S,
        threshold_s: float = STALL_THRESHOLD_S,
        hang_warning_s: float = HANG_WARNING_S,
        warn_interval_s: float = WARN_INTERVAL_S,
        buckets_s: tuple[float, ...] = LAG_BUCKETS_S,
        logger: logging.Logger = log,
    ) -> None:
        for name, value in (("interval_s", interval_s), ("threshold_s", threshold_s),
                            ("hang_warning_s", hang_warning_s),
                            ("warn_interval_s", warn_interval_s)):  # fmt: skip
            if not value > 0:
                raise ValueError(f"{name} must be positive, not {value!r}")
        if not buckets_s or any(b <= a for a, b in itertools.pairwise(buckets_s)):
            raise ValueError("buckets_s must be a non-empty increasing sequence")
        self._interval_s = interval_s
        self._threshold_s = threshold_s
        self._hang_warning_s = hang_warning_s
        self._warn_interval_s = warn_interval_s
        self._bounds = tuple(buckets_s)
        self._log = logger
        self._counts = [0] * (len(buckets_s) + 1)
        self._sum_s = 0.0
        #: stalls over the threshold since the start
        self.stalls = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop_thread_id = 0
        self._base: CodeType | None = None
        # Shared with the watchdog; each is replaced whole (one store, atomic under the GIL).
        self._beat: tuple[int, float] = (0, 0.0)  # (tick number, when it ran)
        self._sample: tuple[int, StackSample] | None = None  # (tick number it follows, stack)
        self._full_collections = gc.get_stats()[2]["collections"]
        self._warned: dict[FrameLine | None, tuple[float, int]] = {}

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start measuring the running loop (call from a coroutine or callback on it).

        Raises ``RuntimeError`` when no loop runs, or when the monitor already runs.
        """
        if self._loop is not None:
            raise RuntimeError("the loop lag monitor already runs")
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._stop.clear()
        self._full_collections = gc.get_stats()[2]["collections"]
        self._beat = (0, time.perf_counter())
        self._handle = self._loop.call_later(self._interval_s, self._tick)
        self._thread = threading.Thread(target=self._watch, name="berth-loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the timer and the watchdog; the histogram keeps what it measured."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self._loop = None

    @property
    def running(self) -> bool:
        return self._loop is not None

    # -- reading --------------------------------------------------------------------------------

    def histogram(self) -> LagHistogram:
        """Every lag measured since the monitor was made."""
        return LagHistogram(self._bounds, tuple(self._counts), self._sum_s)

    # -- the loop's side ------------------------------------------------------------------------

    def _tick(self) -> None:
        now = time.perf_counter()
        seq, beat_at = self._beat
        if self._base is None:
            # The frame that called this callback is the loop's own (Handle._run on asyncio's
            # loop, the frame that entered run_forever on uvloop): sampled stacks end there.
            with contextlib.suppress(ValueError):  # entered from C: stacks are taken whole
                self._base = sys._getframe(1).f_code
        lag_s = max(0.0, now - beat_at - self._interval_s)
        self._counts[bisect_left(self._bounds, lag_s)] += 1
        self._sum_s += lag_s
        full_collections = gc.get_stats()[2]["collections"]  # about 2 µs
        if lag_s > self._threshold_s:
            self._stalled(seq, lag_s, full_gc=full_collections > self._full_collections)
        self._full_collections = full_collections
        self._beat = (seq + 1, now)
        loop = self._loop
        if loop is not None:
            self._handle = loop.call_later(self._interval_s, self._tick)

    def _stalled(self, seq: int, lag_s: float, *, full_gc: bool) -> None:
        self.stalls += 1
        taken = self._sample
        sample = taken[1] if taken is not None and taken[0] == seq else None
        key = sample.callback if sample is not None else None
        now = time.monotonic()
        last_at, left_out = self._warned.get(key, (float("-inf"), 0))
        if now - last_at < self._warn_interval_s:
            self._warned[key] = (last_at, left_out + 1)
            return
        if len(self._warned) >= 256:  # bounded whatever the callbacks are
            self._warned.clear()
        self._warned[key] = (now, 0)
        self._log.warning(
            "%s",
            describe_stall(
                lag_s, sample, left_out=left_out, full_gc=full_gc, threshold_s=self._threshold_s
            ),
        )

    # -- the watchdog's side --------------------------------------------------------------------

    def _watch(self) -> None:
        hang_reported = -1
        while not self._stop.is_set():
            seq, beat_at = self._beat
            due = beat_at + self._interval_s
            now = time.perf_counter()
            if now < due + self._threshold_s:
                self._stop.wait(due + self._threshold_s - now)
                continue  # look at the newest tick again
            taken = self._sample
            if taken is None or taken[0] != seq:
                self._sample = (seq, self._take_sample(now - due))
            if now - due >= self._hang_warning_s and hang_reported != seq:
                hang_reported = seq
                sample = self._sample[1] if self._sample is not None else None
                self._log.warning(
                    "%s",
                    describe_stall(now - due, sample, ongoing=True, threshold_s=self._threshold_s),
                )
            self._stop.wait(self._threshold_s)

    def _take_sample(self, at_s: float) -> StackSample:
        frame = sys._current_frames().get(self._loop_thread_id)
        frames = callback_frames(frame, self._base)
        del frame
        task_name = None
        loop = self._loop
        if frames and loop is not None:
            try:
                task = asyncio.current_task(loop)
            except RuntimeError:
                task = None
            if task is not None:
                task_name = task.get_name()
        return StackSample(frames, task_name, at_s)


__all__ = [
    "HANG_WARNING_S",
    "LAG_BUCKETS_S",
    "STALL_THRESHOLD_S",
    "TICK_INTERVAL_S",
    "FrameLine",
    "LagHistogram",
    "LoopLagMonitor",
    "StackSample",
    "callback_frames",
    "describe_stall",
    "empty_histogram",
    "short_path",
]
