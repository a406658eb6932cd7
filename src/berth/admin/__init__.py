"""The admin API (``/admin/*``, what ``berth`` the CLI calls) and the console's routes.

Owns the FastAPI app of the admin listener (:mod:`.app`), the leader's own state and the
routes that end its run (:mod:`.status`), and one router module per area: keys and usage
(:mod:`.keys`), nodes (:mod:`.nodes`), services (:mod:`.services`), placement plans
(:mod:`.plans`), pulls (:mod:`.pulls`), adapters (:mod:`.adapters`), routing
(:mod:`.routing`), metrics (:mod:`.metrics`), the CA (:mod:`.ca`), a model's detail
(:mod:`.model_detail`) and the console (:mod:`.console`). Each router is given the objects it
uses, so its signature says what its routes touch. The typed request and answer shapes
these routes speak are :mod:`berth.api`'s, shared with the CLI.

May import :mod:`berth.deployments` and every layer below (``auth``, ``console``,
``scaling``, ``routing``, ``admission``, ``cluster``, ``api``, ...). Never
:mod:`berth.gateway`, beside it, nor :mod:`berth.daemon`, which builds the routers from its
object graph (:mod:`berth.daemon.admin_routes`).
"""
