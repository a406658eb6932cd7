"""The deployment manager: what runs where, and keeping it so.

Owns the lifecycle of deployments (:mod:`.lifecycle`: start, stop, the ready table of
:mod:`.ready_table`, the transitions of :mod:`.transitions`), the reconciler against agents'
reports (:mod:`.reconcile`), the supervisor and restart policy (:mod:`.supervisor`,
:mod:`.restarts`), placement's inputs and plans (:mod:`.placement_facts`, :mod:`.planner`,
:mod:`.estimates`), model pulls and registration (:mod:`.pulls`, :mod:`.model_registration`),
LoRA adapters and their load plans (:mod:`.adapters`, :mod:`.lora_plan`), and the scaling
controller's view of the fleet (:mod:`.fleet`).

May import: ``scaling``, ``agent``, ``routing``, ``admission``, ``cluster``,
``observability``, ``api``, ``placement``, ``store``, ``runtime``, ``engine_http``,
``weights``, the vocabulary and the base modules. Never :mod:`berth.gateway`,
:mod:`berth.admin` or :mod:`berth.daemon`: they sit above it and call into it.
"""
