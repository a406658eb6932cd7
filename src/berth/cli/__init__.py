"""The ``berth`` command line: one typer app, one module per command group.

Its one job is turning a command into a call on the layer it fronts and its answer into
lines for a person (or ``--json``): the admin API through :class:`~berth.api.client.
DaemonClient` for most groups (keys, models, deployments, services, routes, nodes, plans,
usage), the daemon to start a leader (:mod:`.daemon_cmd`), the agent (:mod:`.agent_cmd`,
:mod:`.adopt_cmd`), ``berth doctor``, the desk worker, backups and the CA. The root group
(:mod:`.main`) loads a command's module only when that command runs; :mod:`.context` and
:mod:`.common` hold what every command shares (the home, the client, tables, one-line
errors and exit codes).

May import every layer below it; nothing imports it but :mod:`berth.__main__`.
"""
