"""The admin API (``/admin/*``, what ``berth`` the CLI calls) and the console's routes.

Owns the FastAPI app of the admin listener and the plain endpoints (:mod:`.app`), and one
router module per area: keys and usage (:mod:`.keys`), nodes (:mod:`.nodes`), services
(:mod:`.services`), placement plans (:mod:`.plans`), pulls (:mod:`.pulls`), adapters
(:mod:`.adapters`), routing (:mod:`.routing`), metrics (:mod:`.metrics`), a model's detail
(:mod:`.model_detail`) and the console (:mod:`.console`). The typed request and answer
shapes these routes speak are :mod:`berth.api`'s, shared with the CLI.

May import: the leader's object graph (:mod:`berth.daemon.graph`, the one module of
``daemon`` below it), :mod:`berth.gateway`, :mod:`berth.deployments` and every layer below
(``console``, ``scaling``, ``routing``, ``admission``, ``cluster``, ``api``, ...). Never the
rest of :mod:`berth.daemon` (the server and the listeners' handler wire the admin app in).
"""
