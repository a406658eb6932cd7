"""The web console's calls: sign-in sessions (``/ui/session``) and the recent requests
(``GET /admin/requests``)."""

from __future__ import annotations

from berth.api.base import ApiInput, ApiModel
from berth.api.keys import RoleName


class SessionIn(ApiInput):
    """``POST /ui/session``: sign in with an admin key (a standard key is refused, 403)."""

    key: str


class SessionInfo(ApiModel):
    """The signed-in session: the key's name and role (what the console offers follows it;
    the API refuses the rest with 403 either way), the CSRF token every state-changing call
    must send as ``X-CSRF-Token``, and when the session ends at the latest (epoch seconds)."""

    key_name: str
    role: RoleName = "admin"
    csrf_token: str
    expires_at: float


class SessionState(ApiModel):
    """``GET /ui/session``: whether this browser is signed in, and if so its session (an
    answer of 200 either way, so a page that is not signed in logs no failed request)."""

    signed_in: bool
    session: SessionInfo | None


class SignedOut(ApiModel):
    """``DELETE /ui/session``: the session is gone."""

    signed_out: bool = True


class RequestOut(ApiModel):
    """One recent ``/v1`` request (no prompt or answer text is ever kept).

    ``at`` epoch seconds; ``key_name`` ``""`` over the Unix socket; ``node`` and
    ``deployment`` ``""`` when none was chosen; ``ttfb_ms`` time to the first byte of the
    answer (``None``: none was sent); ``retries`` why each earlier attempt moved on.
    """

    seq: int
    at: float
    request_id: str
    key_name: str
    model: str
    node: str
    deployment: str
    status: int
    ttfb_ms: float | None
    duration_ms: float
    prompt_tokens: int
    completion_tokens: int
    retries: list[str]
    error_reason: str | None
    #: of ``prompt_tokens``, those the engine read from its prompt cache, where it says
    #: (Anthropic's ``cache_read_input_tokens``)
    cached_tokens: int = 0


class RequestsPage(ApiModel):
    """``GET /admin/requests?after=SEQ``: the requests after ``SEQ``, oldest first;
    ``last_seq`` is the newest one's number (ask for ``after=last_seq`` next), ``capacity``
    how many the leader keeps."""

    last_seq: int
    capacity: int
    requests: list[RequestOut]
