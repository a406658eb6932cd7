"""Which admin requests only the controller may serve (shared leadership, docs/ha.md).

With ``leader_ha`` the lease holder is the *controller*: it alone starts, stops and places
deployments, changes nodes, services and routes, issues from the CA and pulls weights for
them.  A standby member asked to do any of that has no agent links and a fenced store, so
it would fail half way with a misleading reason (``berth run`` on a standby said "node
gpu-a is not connected").  :func:`controller_only` names those requests; the listeners'
handler (:mod:`berth.daemon.app`) answers them on a standby with
:class:`~berth.store.errors.NotControllerError` (409 ``not_controller``, naming the
controller and its address) before anything is done.

Reads (``GET``, ``HEAD``) are served by every leader; so are a leader's own affairs (its
keys, which every leader follows, ``/admin/leader/step-down``, ``/admin/shutdown``) and
the console's sign-in.
"""

from __future__ import annotations

#: Admin areas whose changes are the controller's, by path prefix.
CONTROL_PREFIXES = (
    "/admin/deployments",
    "/admin/nodes",
    "/admin/services",
    "/admin/routes",
    "/admin/models",
    "/admin/adapters",
    "/admin/plan",
    "/admin/pulls",
    "/admin/ca",
)

_READS = frozenset({"GET", "HEAD", "OPTIONS"})


def controller_only(method: str, path: str) -> bool:
    """Whether ``method`` on ``path`` is a control command only the controller serves."""
    if method.upper() in _READS:
        return False
    return any(path == prefix or path.startswith(prefix + "/") for prefix in CONTROL_PREFIXES)
