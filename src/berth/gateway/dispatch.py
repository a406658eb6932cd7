"""Dispatch with retry before the first byte: walk the router's plan until an engine answers.

Each attempt goes to a deployment not tried yet, at most ``max_attempts`` in all. A failure
that may be its node's (refused, reset, timed out, node unreachable, a 502/503/504 answer)
bars the whole node for the rest of the request; one that is the deployment's own (a first
byte that does not come in time, its deployment given up: failed, stopped or suspect) bars
only that deployment, so a replica beside it on the same node is tried next. An attempt that
fails before the answer's head (refused, reset, timed out, node unreachable), a streamed one
whose first byte does not come within the first-byte timeout (the proxy closes its exchange
and raises :class:`~berth.routing.errors.FirstByteTimeoutError`), or one answered 502/503/504
moves on to the next candidate, while there is one; the rules are
:func:`berth.routing.retry.classify`. So does one whose engine the leader gives up while it
waits (a failed health probe, a failed deployment, a dead link: :mod:`berth.routing.waiting`):
its exchange is closed at once and the next candidate tried, without waiting for the engine
to be stopped or for the read timeout. Nothing has been sent to the client yet, so nothing is
done twice from its point of view. The last attempt's outcome stands: its error (an
OpenAI-shaped 502/504) or its answer.

An engine berth believes ready that refuses the connection or breaks it before answering is
the deployment's failure, not its node's: the deployment is reported (``waiting``'s
``engine_failed``: the lifecycle marks it suspect, out of routing until a probe answers) and
the request goes to another ready deployment, on the same node too.  When none is left, the
request is answered 503 with ``Retry-After``
(:class:`~berth.routing.errors.EngineUnavailableError`), as it is when its engine ended while
it waited; never 502, which stays for a node that could not be reached.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from berth.engine_http.answer import EngineAnswer
from berth.routing.errors import (
    EngineTimeoutError,
    EngineUnavailableError,
    EngineUnreachableError,
    FirstByteTimeoutError,
    ProxyError,
)
from berth.routing.retry import AttemptFailure, classify
from berth.routing.signals import SignalBoard
from berth.routing.waiting import GiveUp, WaitingAttempts

if TYPE_CHECKING:
    from berth.routing.resolver import Upstream

log = logging.getLogger(__name__)

Attempt = Callable[["Upstream"], Awaitable[EngineAnswer]]


async def first_answer(
    plan: Sequence[Upstream],
    attempt: Attempt,
    *,
    max_attempts: int,
    signals: SignalBoard,
    clock: Callable[[], float],
    request_id: str,
    waiting: WaitingAttempts | None = None,
) -> tuple[Upstream, EngineAnswer]:
    """The first usable answer along ``plan``, and the upstream that gave it.

    ``attempt(upstream)`` sends the request and returns once the answer's head is in, or
    raises a :class:`ProxyError` (nothing reached the client). While it waits, the attempt
    is registered in ``waiting``, so that giving its engine up cancels it (closing its
    exchange) and moves the request on. The chosen upstream is left counted in flight in
    ``signals``: the caller calls ``signals.finished`` when the exchange is over. Raises the
    last attempt's ``ProxyError`` when none answered (``EngineUnreachableError`` for an
    attempt whose engine was given up with nowhere else to go).
    """
    task = asyncio.current_task() if waiting is not None else None
    tried: set[str] = set()  # deployments
    barred: set[str] = set()  # nodes
    for index, upstream in enumerate(plan):
        if upstream.deployment_id in tried or upstream.node_id in barred:
            continue
        tried.add(upstream.deployment_id)
        rest = plan[index + 1 :]
        room = len(tried) < max_attempts
        # Another candidate after a failure of this deployment's own, and after one of its node's.
        more = room and _another(rest, tried, barred)
        more_off_node = room and _another(rest, tried, barred | {upstream.node_id})
        signals.started(upstream.deployment_id, upstream.node_id)
        begun = clock()
        registered = None
        if waiting is not None and task is not None:
            registered = waiting.add(upstream, task, elsewhere=more)
        try:
            answer = await attempt(upstream)
        except asyncio.CancelledError:
            signals.finished(upstream.deployment_id, upstream.node_id)
            if registered is None or registered.given_up is None or registered.task.uncancel():
                raise  # the client left, or the server is shutting down
            # Given up while waiting: the cancellation closed the exchange with the engine.
            signals.failed(upstream.deployment_id)
            if registered.given_up is GiveUp.NODE_LOST:
                barred.add(upstream.node_id)
                more = more_off_node
            if not more:
                why = f"was given up before answering ({registered.reason})"
                if registered.given_up is GiveUp.NODE_LOST:
                    raise EngineUnreachableError(upstream, why) from None
                raise EngineUnavailableError(upstream, why) from None
            log.warning("request %s: deployment %s %s; trying another deployment",
                        request_id, upstream.deployment_id, registered.reason)  # fmt: skip
            continue
        except ProxyError as exc:
            signals.finished(upstream.deployment_id, upstream.node_id)
            signals.failed(upstream.deployment_id)
            failure = (
                AttemptFailure.FIRST_BYTE_TIMEOUT if isinstance(exc, FirstByteTimeoutError)
                else AttemptFailure.TIMEOUT if isinstance(exc, EngineTimeoutError)
                else AttemptFailure.CONNECT
            )  # fmt: skip
            engine_side = isinstance(exc, EngineUnreachableError) and exc.engine_side
            if engine_side:
                assert isinstance(exc, EngineUnreachableError)
                if waiting is not None:  # suspect: out of routing until a probe answers
                    waiting.engine_failed(upstream, exc.why)
            elif failure is not AttemptFailure.FIRST_BYTE_TIMEOUT:
                barred.add(upstream.node_id)
                more = more_off_node
            if not more or classify(failure) != "retry":
                if engine_side and not isinstance(exc, EngineUnavailableError):
                    assert isinstance(exc, EngineUnreachableError)
                    raise EngineUnavailableError(upstream, exc.why) from exc
                raise
            log.warning("request %s: %s; trying another candidate", request_id, exc)
            continue
        except BaseException:
            signals.finished(upstream.deployment_id, upstream.node_id)
            raise
        finally:
            if registered is not None and waiting is not None:
                waiting.remove(registered)
        if answer.status < 500:
            # Only real answers are latency samples: a quick 503 must not look fast.
            signals.observe(upstream.deployment_id, clock() - begun)
            signals.succeeded(upstream.deployment_id)
        elif classify(None, answer.status) == "retry":
            signals.failed(upstream.deployment_id)
            barred.add(upstream.node_id)
            if more_off_node:
                log.warning("request %s: deployment %s answered %d; trying another node",
                            request_id, upstream.deployment_id, answer.status)  # fmt: skip
                answer.close()
                signals.finished(upstream.deployment_id, upstream.node_id)
                continue
        return upstream, answer
    raise AssertionError("first_answer needs a non-empty plan")  # the resolver never gives one


def _another(rest: Sequence[Upstream], tried: set[str], barred: set[str]) -> bool:
    """Whether ``rest`` holds a deployment not tried yet on a node not barred."""
    return any(u.deployment_id not in tried and u.node_id not in barred for u in rest)
