"""Routing: which deployment serves a request, and what to do when an attempt fails.

The decisions are pure (``scorer.rank``, ``retry.classify``, ``affinity.affinity_key``);
``router.Router`` feeds them the live signals and the affinity map, and the proxy walks the
ranked list (``gateway/dispatch.py``).
"""
