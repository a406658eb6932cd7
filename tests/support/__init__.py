"""Helpers shared by the tests: stand-ins for engines, agents and the Hugging Face hub, a real
cluster on loopback, the proxy served on loopback, waiting for events, and the policy for
parts of the test environment that ``scripts/setup.sh`` installs.

The shared fixtures built on these live in ``tests/conftest.py``.  Modules here import
nothing from test modules, and ``fake_llama_server.py`` uses only the standard library,
because it is run as a script by path (:data:`support.fake_llama_server.SCRIPT`).
"""
