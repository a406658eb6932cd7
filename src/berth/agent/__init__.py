"""The agent: what runs a host's engines for a leader, on every host berth manages.

Its one job is carrying out, on this host, what the leader asks over the agent link, and
telling the leader what is there. Owns the agent core (:mod:`.core`: start, stop, probe and
take back engines, with the engine journal :mod:`.journal`, its owner lock :mod:`.owner` and
the warden that stops orphaned engines :mod:`.warden`; what a start prepares,
:mod:`.engine_launch`; this host's facts, :mod:`.host`; adopted servers, :mod:`.adopted`), the
two ways the leader reaches it (in the leader's own process for node ``local``,
:mod:`.in_process_link`; over the link from another host: the dial loop :mod:`.dialer`, the
requests and streams :mod:`.service`, one HTTP exchange relayed to an engine :mod:`.relay`
and :mod:`.answer_push`, the direct ingress :mod:`.ingress`, the leaders it may dial
:mod:`.leaders`), its load reports (:mod:`.node_sampler`), its identity and certificate
(:mod:`.registration`, :mod:`.identity`, :mod:`.cert_pair`, :mod:`.renewal`) and what runs
it as a process and a service (:mod:`.runner`, :mod:`.status`, :mod:`.systemd_unit`).

May import :mod:`berth.cluster` (whose link interfaces it implements), the runtime, the wire
formats, the vocabulary and the base modules; never :mod:`berth.routing`, beside it, nor
anything of the leader's (the store, the deployment manager, the daemon).
"""
