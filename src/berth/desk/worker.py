"""``berth desk serve``'s loop: pulses, claims, and the jobs they bring.

One supervisor ticks about every second. Every :attr:`WorkerTimings.refresh_s` it asks the
leader what it serves; the registered models among those are *offered*. For each offered
model it keeps a claim loop (the protocol's "Claim": ``204`` → ask again in about 2 s, the
``x-ow-wait`` header only when one model is offered), sends pulses when due
(:func:`~berth.desk.pulse.pulse_due`), runs the speed test once (in one of the model's slots,
so no job shares the engine with it), and requests a pool test when none was accepted in the
last 12 hours.

A job runs as its own task, never more at once per model than the model has slots: its
prompt (opened here when sealed) goes to the leader as one chat request with an 80 s limit,
and the answer to ``jobs/finish`` with the engine's token counts. ``jobs/fail`` is sent when
the leader or the engine errors or does not answer, the prompt does not open, the job is
malformed, or the finish does not land; a failed job is never retried.

The prompt and the answer live in the job task's memory only: no log line, file or error
message here carries either. A desk or leader that errors, does not answer or answers
malformed JSON is logged in one line and retried after a capped, jittered backoff; nothing
here ends the loop but cancellation (a signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from berth.backoff import Backoff
from berth.desk.client import DeskClient
from berth.desk.errors import (
    DeskError,
    DeskProtocolError,
    LeaderAnswerError,
    LeaderUnavailableError,
)
from berth.desk.leader import ChatAnswer, Leader, job_request, speed_test_request
from berth.desk.pulse import (
    PULSE_EVERY_S,
    ModelServing,
    SentPulse,
    build_pulse,
    pulse_due,
    tokens_per_second,
)
from berth.desk.sealing import HostKeyPair, open_sealed_prompt
from berth.desk.state import DeskFiles, RegisteredNode, load_nodes, record_check_accepted
from berth.desk.wire import MODEL_ID_PATTERN, ClaimedJob, Finish, is_model_id
from berth.errors import ConfigError

log = logging.getLogger("berth.desk")


@dataclass(frozen=True)
class WorkerTimings:
    """Every interval of the loop, in seconds (the defaults are the protocol's)."""

    #: After a ``204`` (no work): "ow asks again in about two seconds".
    claim_idle_s: float = 2.0
    #: Between pulses when nothing changed: "about every 30 seconds".
    pulse_every_s: float = PULSE_EVERY_S
    #: Between looks at what the leader serves (the nodes report load this often too).
    refresh_s: float = 5.0
    #: A job's limit: "80 second limit".
    job_timeout_s: float = 80.0
    #: Backoff after a failed desk or leader call: first delay and cap.
    backoff_first_s: float = 2.0
    backoff_max_s: float = 60.0
    #: A pool test is requested again this long after one was accepted: "12 hours".
    check_every_s: float = 12 * 3600.0
    #: After a refused pool test request, or a speed test that measured nothing.
    check_retry_s: float = 600.0
    speed_retry_s: float = 60.0
    #: The supervisor's tick.
    tick_s: float = 1.0
    #: How long a ``jobs/fail`` may take while the worker stops.
    stop_fail_timeout_s: float = 5.0


@dataclass
class _NodeState:
    """What the supervisor tracks per offered node."""

    node: RegisteredNode
    claims: asyncio.Task[None] | None = None
    sent: SentPulse | None = None
    pulsing: bool = False
    pulse_backoff: Backoff | None = None
    pulse_not_before: float = 0.0
    check_not_before: float = 0.0
    checking: bool = False


class DeskWorker:
    """The pulse and claim loop of one host (see the module docstring).

    ``nodes`` are the registered models (``nodes.json``, read again when it changes, so a
    model registered while the worker runs is offered at the next refresh); ``wait_s`` is
    the ``x-ow-wait`` to send when one model is offered (``None``: never). ``clock`` is
    monotonic seconds and ``wall_clock`` seconds since the epoch (both replaceable in tests).
    """

    def __init__(
        self,
        *,
        desk: DeskClient,
        leader: Leader,
        files: DeskFiles,
        nodes: list[RegisteredNode],
        keys: HostKeyPair,
        wait_s: int | None = None,
        timings: WorkerTimings | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._desk = desk
        self._leader = leader
        self._files = files
        self._registered = {node.model: node for node in nodes}
        self._nodes_stamp = self._stamp()
        self._keys = keys
        self._wait_s = wait_s
        self._timings = timings or WorkerTimings()
        self._clock = clock
        self._wall_clock = wall_clock
        self._nodes: dict[str, _NodeState] = {}
        self._serving: dict[str, ModelServing] = {}
        self._own_jobs: dict[str, int] = {}
        self._jobs: set[asyncio.Task[None]] = set()
        self._helpers: set[asyncio.Task[None]] = set()
        self._speed: dict[str, float] = {}
        self._speed_not_before: dict[str, float] = {}
        self._measuring = False
        self._next_refresh = 0.0
        self._refresh_backoff = Backoff(self._timings.backoff_first_s, self._timings.backoff_max_s)
        self._leader_problem: str | None = None
        self._noted: set[str] = set()
        self._wake = asyncio.Event()
        self._room = asyncio.Condition()
        self.finished = 0
        self.failed = 0

    @property
    def offered(self) -> list[str]:
        """The models offered to the desk right now (registered and served)."""
        return list(self._nodes)

    async def run(self) -> None:
        """Serve until cancelled; then stop the claims and report running jobs failed."""
        log.info("desk worker started: %d registered model(s)", len(self._registered))
        trouble = Backoff(self._timings.backoff_first_s, self._timings.backoff_max_s)
        try:
            while True:
                try:
                    await self._tick()
                    trouble.reset()
                except Exception:  # the loop boundary: a bug must not end every offer
                    delay = trouble.next_delay_s()
                    log.exception("desk worker: unexpected error (going on in %.0f s)", delay)
                    await asyncio.sleep(delay)
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancellation that arrives as the event is set, and the loop would never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._timings.tick_s):
                        await self._wake.wait()
                self._wake.clear()
        finally:
            await self._stop()

    # -- the supervisor ----------------------------------------------------------------------

    async def _tick(self) -> None:
        now = self._clock()
        if now >= self._next_refresh:
            await self._refresh(now)
        models = tuple(self._nodes)
        for state in self._nodes.values():
            self._maybe_pulse(state, models, now)
            self._maybe_check(state, now)
        self._maybe_measure(now)

    def _stamp(self) -> int | None:
        try:
            return self._files.nodes_file.stat().st_mtime_ns
        except OSError:
            return None

    def _pick_up_registrations(self) -> None:
        """Models registered while the worker runs (``nodes.json`` changed) are added."""
        stamp = self._stamp()
        if stamp == self._nodes_stamp:
            return
        self._nodes_stamp = stamp
        try:
            book = load_nodes(self._files)
        except ConfigError as exc:
            log.warning("%s; keeping the nodes read before", exc)
            return
        for node in book.nodes:
            if node.model not in self._registered:
                self._registered[node.model] = node
                log.info("model %s was registered (node code %s)", node.model, node.code)

    async def _refresh(self, now: float) -> None:
        self._pick_up_registrations()
        try:
            served = await self._leader.served_models()
            valid = [name for name in served if self._valid(name)]
            wanted = [name for name in valid if name in self._registered]
            serving = await self._leader.serving(wanted)
        except (LeaderUnavailableError, LeaderAnswerError) as exc:
            delay = self._refresh_backoff.next_delay_s()
            self._next_refresh = now + delay
            problem = str(exc)
            if problem != self._leader_problem:
                log.warning("%s; nothing is offered until it answers (again in %.0f s)",
                            problem, delay)  # fmt: skip
            self._leader_problem = problem
            serving = {}
        else:
            self._refresh_backoff.reset()
            self._next_refresh = now + self._timings.refresh_s
            if self._leader_problem is not None:
                log.info("the leader answers again")
            self._leader_problem = None
            for name in valid:
                if name not in self._registered:
                    self._note_once(
                        f"unregistered:{name}",
                        "model %s is served but not registered with the desk "
                        "(berth desk register --model %s)",
                        name,
                        name,
                    )
        self._serving = serving
        self._sync_offered()
        async with self._room:
            self._room.notify_all()

    def _valid(self, name: str) -> bool:
        if is_model_id(name):
            return True
        self._note_once(
            f"invalid:{name}",
            "served model %r is not a valid desk model id (%s); skipped",
            name,
            MODEL_ID_PATTERN.pattern,
        )
        return False

    def _note_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.warning(message, *args)

    def _sync_offered(self) -> None:
        for model in [m for m in self._nodes if m not in self._serving]:
            state = self._nodes.pop(model)
            if state.claims is not None:
                state.claims.cancel()
            log.info("model %s is no longer served: not offered", model)
        for model in self._serving:
            if model not in self._nodes:
                state = _NodeState(node=self._registered[model])
                state.pulse_backoff = Backoff(
                    self._timings.backoff_first_s, self._timings.backoff_max_s
                )
                state.claims = asyncio.create_task(self._claim_loop(state.node))
                self._nodes[model] = state
                log.info("offering model %s (node code %s)", model, state.node.code)
        if self._wait_s is not None and len(self._nodes) > 1:
            self._note_once(
                "wait", "--wait is for one-model hosts: %d models are offered, so it is not sent",
                len(self._nodes),
            )  # fmt: skip

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)

    # -- pulses, speed test, pool test ---------------------------------------------------------

    def _maybe_pulse(self, state: _NodeState, models: tuple[str, ...], now: float) -> None:
        serving = self._serving.get(state.node.model)
        if serving is None or state.pulsing or now < state.pulse_not_before:
            return
        pulse = build_pulse(
            serving,
            own_jobs=self._own_jobs.get(state.node.model, 0),
            tok_per_s=self._speed.get(state.node.model),
            models=models,
            enc_pubkey=self._keys.public_b64,
        )
        if not pulse_due(state.sent, pulse, now, every_s=self._timings.pulse_every_s):
            return
        state.pulsing = True

        async def send() -> None:
            try:
                await self._desk.pulse(state.node.secret, pulse)
            except DeskError as exc:
                assert state.pulse_backoff is not None
                delay = state.pulse_backoff.next_delay_s()
                state.pulse_not_before = self._clock() + delay
                log.warning("%s: pulse failed: %s (again in %.0f s)",
                            state.node.model, exc, delay)  # fmt: skip
            else:
                assert state.pulse_backoff is not None
                if state.sent is None or state.pulse_backoff.failures:
                    log.info("%s: pulse sent (busy %s, %d slot(s))",
                             state.node.model, pulse.busy, pulse.slots)  # fmt: skip
                state.pulse_backoff.reset()
                state.sent = SentPulse(at=self._clock(), busy=pulse.busy, models=models)
            finally:
                state.pulsing = False

        self._spawn(send())

    def _maybe_measure(self, now: float) -> None:
        if self._measuring:
            return
        for model in self._nodes:
            due = now >= self._speed_not_before.get(model, 0.0)
            if model not in self._speed and due and self._has_room(model):
                # The test takes one of the model's slots, so no job shares the engine with it
                # (the figure would be too low) and the pulses show the slot in use.
                self._measuring = True
                self._own_jobs[model] = self._own_jobs.get(model, 0) + 1
                self._spawn(self._measure(model))
                return

    async def _measure(self, model: str) -> None:
        try:
            started = self._clock()
            answer = await self._leader.chat(
                speed_test_request(model), timeout_s=self._timings.job_timeout_s
            )
            speed = tokens_per_second(answer.completion_tokens, self._clock() - started)
            if speed is None:
                log.warning("%s: the speed test measured nothing (no token count)", model)
                self._speed_not_before[model] = self._clock() + self._timings.speed_retry_s
            else:
                self._speed[model] = speed
                log.info("%s: speed test: %.1f tokens/s", model, speed)
        except (LeaderUnavailableError, LeaderAnswerError) as exc:
            log.warning("%s: the speed test failed: %s", model, exc)
            self._speed_not_before[model] = self._clock() + self._timings.speed_retry_s
        finally:
            self._measuring = False
            self._own_jobs[model] -= 1
            self._wake.set()
            async with self._room:
                self._room.notify_all()

    def _maybe_check(self, state: _NodeState, now: float) -> None:
        node = state.node
        if state.sent is None or state.checking or now < state.check_not_before:
            return
        accepted = node.check_accepted_at
        if accepted is not None and self._wall_clock() - accepted < self._timings.check_every_s:
            return
        state.checking = True

        async def request() -> None:
            try:
                await self._desk.request_check(node.secret)
            except DeskError as exc:
                state.check_not_before = self._clock() + self._timings.check_retry_s
                log.warning("%s: pool test request failed: %s", node.model, exc)
            else:
                node.check_accepted_at = self._wall_clock()
                record_check_accepted(self._files, node.model, node.check_accepted_at)
                log.info("%s: pool test requested", node.model)
            finally:
                state.checking = False

        self._spawn(request())

    # -- claims and jobs -----------------------------------------------------------------------

    def _has_room(self, model: str) -> bool:
        serving = self._serving.get(model)
        return serving is not None and self._own_jobs.get(model, 0) < serving.slots

    async def _claim_loop(self, node: RegisteredNode) -> None:
        backoff = Backoff(self._timings.backoff_first_s, self._timings.backoff_max_s)
        while True:
            async with self._room:
                await self._room.wait_for(lambda: self._has_room(node.model))
            wait_s = self._wait_s if len(self._nodes) == 1 else None
            try:
                job = await self._desk.claim(node.secret, wait_s=wait_s)
            except DeskError as exc:
                delay = backoff.next_delay_s()
                log.warning("%s: claim failed: %s (again in %.0f s)", node.model, exc, delay)
                await asyncio.sleep(delay)
                continue
            except Exception:  # the loop boundary: a bug must not end this model's claims
                delay = backoff.next_delay_s()
                log.exception("%s: claim failed unexpectedly (again in %.0f s)", node.model, delay)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            if job is None:
                await asyncio.sleep(self._timings.claim_idle_s)
                continue
            self._own_jobs[node.model] = self._own_jobs.get(node.model, 0) + 1
            self._wake.set()
            task = asyncio.create_task(self._run_job(node, job))
            self._jobs.add(task)
            task.add_done_callback(self._jobs.discard)

    async def _run_job(self, node: RegisteredNode, job: ClaimedJob) -> None:
        kind = "pool test" if job.is_pool_test else "job"
        finishing = False
        try:
            log.info("%s %s (%s): claimed", kind, job.id, node.model)
            try:
                answer = await self._answer(node, job)
            except DeskError as exc:
                log.warning("%s %s (%s): %s; reporting it failed", kind, job.id, node.model, exc)
                await self._report_failed(node, job.id)
                return
            except Exception:  # a bug: the job must still end in a fail, and be logged
                log.exception("%s %s (%s): unexpected error; reporting it failed",
                              kind, job.id, node.model)  # fmt: skip
                await self._report_failed(node, job.id)
                return
            finish = Finish(
                id=job.id,
                output=answer.output,
                prompt_tokens=answer.prompt_tokens,
                completion_tokens=answer.completion_tokens,
            )
            finishing = True  # from here a fail could contradict a finish that landed
            try:
                await self._desk.finish(node.secret, finish)
            except DeskError as exc:
                log.warning("%s %s (%s): the finish did not land: %s; reporting it failed",
                            kind, job.id, node.model, exc)  # fmt: skip
                await self._report_failed(node, job.id)
                return
            self.finished += 1
            log.info("%s %s (%s): finished: %d prompt + %d completion tokens", kind, job.id,
                     node.model, answer.prompt_tokens, answer.completion_tokens)  # fmt: skip
        except asyncio.CancelledError:
            if finishing:
                log.info("%s %s (%s): stopped while its finish was on its way",
                         kind, job.id, node.model)  # fmt: skip
            else:
                log.info("%s %s (%s): stopped before its answer; reporting it failed",
                         kind, job.id, node.model)  # fmt: skip
                await self._report_failed(node, job.id, timeout_s=self._timings.stop_fail_timeout_s)
            raise
        finally:
            self._own_jobs[node.model] -= 1
            self._wake.set()
            async with self._room:
                self._room.notify_all()

    async def _answer(self, node: RegisteredNode, job: ClaimedJob) -> ChatAnswer:
        """The engine's answer to ``job``; raises a :class:`DeskError` for every reason to
        fail it (the prompt stays in this frame)."""
        if job.model != node.model:
            raise DeskProtocolError("jobs/claim", f"the job names model {job.model!r}")
        if job.mode() == "sealed":
            prompt = open_sealed_prompt(
                job.sealed_prompt(), job_id=job.id, node_secret=node.secret, keys=self._keys
            )
        else:
            prompt = job.prompt
        request = job_request(node.model, prompt, pool_test=job.is_pool_test)
        return await self._leader.chat(request, timeout_s=self._timings.job_timeout_s)

    async def _report_failed(
        self, node: RegisteredNode, job_id: str, *, timeout_s: float | None = None
    ) -> None:
        self.failed += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self._desk.fail(node.secret, job_id)
        except (DeskError, TimeoutError) as exc:
            log.warning("job %s: the fail did not land either: %s", job_id, exc or "timed out")

    async def _stop(self) -> None:
        for state in self._nodes.values():
            if state.claims is not None:
                state.claims.cancel()
        tasks = [s.claims for s in self._nodes.values() if s.claims is not None]
        tasks += [*self._jobs, *self._helpers]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.info("desk worker stopped: %d job(s) finished, %d failed", self.finished, self.failed)
