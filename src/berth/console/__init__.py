"""The web console: static files the leader serves at ``/ui/`` and the sign-in sessions
behind them.

The console is plain HTML, CSS and JavaScript under ``static/`` (no build step, nothing
fetched from elsewhere at run time), talking only to the leader's admin API and ``/v1``.
A browser signs in once with an admin key, which the leader exchanges for a session cookie
(:mod:`berth.console.sessions`); the key itself is never kept in the browser. The daemon wires
the routes (``admin/console.py``); docs in ``docs/console.md``.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable


def static_files() -> Traversable:
    """The folder of the console's files, inside the installed package."""
    return files(__name__) / "static"
