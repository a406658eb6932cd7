"""berth's HTTP/1.1 server: the leader's public listener and its local socket.

An ``asyncio.Protocol`` per connection parses requests with ``httptools`` (llhttp, the parser
berth's engine client and uvicorn use) and enforces the listener's bounds from the first
byte (:mod:`berth.http_server.limits`). Each request goes to one handler coroutine with a
:class:`~berth.http_server.request.Request` and a
:class:`~berth.http_server.writer.ResponseWriter` that writes straight to the transport;
:mod:`berth.http_server.asgi` adapts an ASGI app (the admin API) to that handler shape.
"""
