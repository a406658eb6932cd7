"""What berth says about itself while it runs: Prometheus series, traces, request records.

Owns the proxy's and the deployments' series (:mod:`.metrics`), every node's load as the
leader sees it from heartbeats (:mod:`.cluster`) over rolling request windows (:mod:`.window`,
pure), the LoRA adapters' series (:mod:`.adapters`), event-loop lag and what held the loop
(:mod:`.loop_lag`), the last requests for the console (:mod:`.request_log`), and OpenTelemetry
tracing: the settings (:mod:`.tracing_config`), opening it (:mod:`.tracing_setup`), the
leader's spans (:mod:`.tracing`), the agent's (:mod:`.relay_tracing`), W3C Trace Context on
byte headers (:mod:`.trace_context`) and an export that never waits (:mod:`.span_export`).
It records and reports; it decides nothing.

May import the settings, the vocabulary and the base modules; nothing of ``cluster`` (what
it reads of a heartbeat is its own protocols, :mod:`.node_report`), routing or the leader's
subsystems, which feed it.
"""
