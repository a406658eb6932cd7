"""Which of a request's candidates can serve its path: a pure step after the router's plan.

Every engine berth runs serves OpenAI's paths; Anthropic's Messages API (``/v1/messages``,
``/v1/messages/count_tokens``) only some (:data:`berth.runtime.engines.EXTRA_PATHS`). A
request for such a path goes only to the deployments whose engine serves it, in the order
the router ranked them; when none does, a token count is refused (400) with a message naming
each deployment and why, rather than sent to an engine that would answer 404 or worse. A
Messages request is then translated to ``/v1/chat/completions`` instead
(:mod:`berth.gateway.messages_bridge`, which calls :func:`serving` only when it passes a
request through).
"""

from __future__ import annotations

from collections.abc import Sequence

from berth.routing.errors import InvalidRequestError
from berth.routing.resolver import Upstream
from berth.vocab.engines import serves_path


def serving(plan: Sequence[Upstream], path: str) -> list[Upstream]:
    """The upstreams of ``plan`` whose engine serves ``path``, in ``plan``'s order.

    Raises :class:`InvalidRequestError` (400, code ``path_not_served``) when none does,
    naming each deployment's engine (or that an adopted endpoint's is not known).
    """
    kept = [upstream for upstream in plan if serves_path(upstream.engine, path)]
    if kept:
        return kept
    why = "; ".join(sorted({_why_not(upstream, path) for upstream in plan}))
    raise InvalidRequestError(
        f"{why}; a token count is not translated to /v1/chat/completions, which counts none",
        code="path_not_served",
    )


def _why_not(upstream: Upstream, path: str) -> str:
    if upstream.engine is None:  # an adopted endpoint (its id: "adopted:<name>")
        return f"{upstream.deployment_id}'s engine is not known to serve {path}"
    return f"deployment {upstream.deployment_id}'s engine ({upstream.engine}) does not serve {path}"
