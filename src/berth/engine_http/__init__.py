"""berth's HTTP/1.1 client to engines, shared by the leader's proxy and every agent.

``origin`` (where an engine answers), ``pool`` (keep-alive connections, one request at a
time each), ``connection`` (one connection's ``asyncio.Protocol`` and httptools parser),
``response`` (an answer as it arrives), ``answer`` (the reading interface tunneled answers
share), ``auth`` (the engine's own key as a Bearer header, client credentials dropped),
``errors``. It knows nothing of deployments, nodes or routing.
"""
