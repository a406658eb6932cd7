"""The berth exception hierarchy.

::

    BerthError
    ├── ConfigError            a malformed config file or an invalid setting (path, line)
    ├── StoreError             the database could not be opened or migrated
    ├── NotFoundError          a named model, deployment, key or node does not exist
    ├── ConflictError          a name is taken, or an operation clashes with current state
    ├── InvalidTransitionError a deployment state change the state machine forbids
    ├── EngineError            an engine failed to start, answer health or stop (log tail)
    ├── PolicyError            a node's agent policy refuses a start (the rule, the node)
    ├── AuthError              a missing, unknown or insufficient API key
    │   ├── EnrollmentTokenError  an enrollment token that is unknown, used or expired
    │   └── RoleError          an admin key whose role is too low for the route (403)
    ├── RateLimitError         too many attempts from one source (``retry_after_s``)
    └── DaemonError            the daemon is not running, or could not be reached

Domain code raises these; the edges translate them once: the HTTP apps map them to
OpenAI-style JSON errors, the CLI maps them to a one-line message and an exit code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

#: The exit status of a leader that handed its lease over (``berth leader step-down``) or
#: lost it while running engines on its own host: not an error, and a service manager should
#: start it again, as a standby.  75 is ``EX_TEMPFAIL`` of sysexits.h ("try again later"),
#: beside the errors' own exit codes (1 to 3).  Its unit restarts on it.
STANDBY_RESTART_EXIT: Final = 75


class BerthError(Exception):
    """Base class of every error berth raises on purpose."""

    #: HTTP status the admin and OpenAI APIs answer with for this error.
    http_status: int = 500
    #: OpenAI-style error ``type`` field.
    error_type: str = "server_error"
    #: CLI exit code.
    exit_code: int = 1


class ConfigError(BerthError):
    """A configuration file or setting is invalid.

    ``path`` and ``line`` locate the problem when it comes from a file.
    """

    http_status = 400
    error_type = "invalid_request_error"
    exit_code = 2

    def __init__(self, message: str, *, path: Path | None = None, line: int | None = None):
        self.path = path
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(f"{where}{message}")


class StoreError(BerthError):
    """The state database could not be opened, migrated or written."""


class NotFoundError(BerthError):
    """A named object does not exist; ``kind`` is e.g. ``"model"``, ``ident`` its name or id.

    ``message`` replaces the usual ``"model 'x' not found"`` (the CLI keeps the daemon's).
    """

    http_status = 404
    error_type = "invalid_request_error"
    exit_code = 2

    def __init__(self, kind: str, ident: str, *, message: str | None = None):
        self.kind = kind
        self.ident = ident
        super().__init__(message or f"{kind} {ident!r} not found")

    @property
    def not_found_code(self) -> str:
        """The OpenAI error ``code`` of this error: ``<kind>_not_found``, the kind in lower
        case with its spaces as underscores (``"API key"``: ``api_key_not_found``)."""
        return "_".join(self.kind.lower().split()) + "_not_found"


class ConflictError(BerthError):
    """The request clashes with existing state (a taken name, a busy object)."""

    http_status = 409
    error_type = "invalid_request_error"
    exit_code = 2


class InvalidTransitionError(BerthError):
    """A deployment was asked to move between states the state machine does not connect."""

    http_status = 409
    error_type = "invalid_request_error"

    def __init__(self, deployment_id: str, current: str, target: str):
        self.deployment_id = deployment_id
        self.current = current
        self.target = target
        super().__init__(f"deployment {deployment_id}: cannot move from {current} to {target}")


class EngineError(BerthError):
    """An engine failed to start, become healthy or stop.

    ``log_tail`` holds the last lines the engine wrote, for the operator.
    """

    http_status = 502
    error_type = "engine_error"

    def __init__(self, message: str, *, deployment_id: str | None = None, log_tail: str = ""):
        self.deployment_id = deployment_id
        self.log_tail = log_tail
        full = message
        if log_tail:
            full = f"{message}\n--- engine log tail ---\n{log_tail.rstrip()}"
        super().__init__(full)


class PolicyError(BerthError):
    """A node's agent policy refuses to start what was asked (403, code ``policy_refused``).

    ``rule`` names the rule broken (``engines``, ``images``, ``model_roots``,
    ``engine_args``, ``gpus``, ``docker``: :mod:`berth.vocab.agent_policy`); ``node_id``
    the node whose policy it is, when known.
    """

    http_status = 403
    error_type = "permission_error"
    error_code = "policy_refused"
    exit_code = 2

    def __init__(self, message: str, *, rule: str, node_id: str | None = None):
        self.rule = rule
        self.node_id = node_id
        super().__init__(message)


class AuthError(BerthError):
    """A request lacks a valid key, or its key's tier is too low (``status`` 401 or 403)."""

    error_type = "authentication_error"

    def __init__(self, message: str, *, status: int = 401):
        self.http_status = status
        if status == 403:
            self.error_type = "permission_error"
        super().__init__(message)


class RoleError(AuthError):
    """An admin key's role is below the one a route needs (403, code ``role_too_low``);
    ``needed`` and ``held`` are the role names (:class:`berth.vocab.roles.Role`)."""

    error_code = "role_too_low"

    def __init__(self, message: str, *, needed: str, held: str):
        self.needed = needed
        self.held = held
        super().__init__(message, status=403)


class EnrollmentTokenError(AuthError):
    """An enrollment token was refused; ``reason`` is ``unknown``, ``used`` or ``expired``.

    ``error_code`` (``enrollment_token_<reason>``) becomes the OpenAI error ``code`` field.
    """

    def __init__(self, reason: str, message: str):
        self.reason = reason
        self.error_code = f"enrollment_token_{reason}"
        super().__init__(message)


class RateLimitError(BerthError):
    """Too many attempts from one source; retry after ``retry_after_s`` seconds."""

    http_status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class DaemonError(BerthError):
    """The daemon is not running, did not start, or could not be reached."""

    exit_code = 3
