"""berth's vocabulary: the frozen values every layer speaks, with no I/O.

Records the store returns and the admin API shows (:mod:`.records`), the deployment state
machine (:mod:`.states`), engine and runtime names (:mod:`.engines`), the restart and routing
policies (:mod:`.policies`), one GPU as a node reports it (:mod:`.gpu`), what an engine is
asked to run (:mod:`.deployment_request`), a key's limits (:mod:`.limits`), an engine's
slots from its arguments (:mod:`.slots`), the engines' published images (:mod:`.images`),
and a key's tier and an admin key's role (:mod:`.roles`).

A leaf: it imports the standard library and berth's base modules (:mod:`berth.errors`), and
nothing that does I/O, so a process that only serves ``/v1``, the CLI and the pure deciders
(placement, scaling, routing, admission) import it without SQLAlchemy or NVML.
``tests/test_vocab.py`` holds it to that.
"""
