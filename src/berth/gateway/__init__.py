"""The ``/v1`` request path: an authenticated public request to an engine and its answer back.

Owns the OpenAI-compatible proxy (:mod:`.proxy`), its ASGI twin (:mod:`.asgi`), the request
value parsed once (:mod:`.request`) and the stages it goes through (:mod:`.stages`, the
attempt stage :mod:`.attempt`, in order in :mod:`.completions`; what each request leaves
:mod:`.record`, refusals :mod:`.refusals`), the attempts across upstreams (:mod:`.dispatch`),
one HTTP exchange with a client (:mod:`.exchange`), the answer's relay (:mod:`.relay`,
:mod:`.push`, :mod:`.outcome`, :mod:`.sse`, :mod:`.read_ahead`), asking a stream's usage
(:mod:`.usage`), Anthropic's Messages API translated to and from chat completions for
engines that do not serve it (:mod:`.messages_bridge` over :mod:`.anthropic_chat`,
:mod:`.anthropic_answer`, :mod:`.anthropic_stream`), the engine client (pooled HTTP/1.1 or
an agent's tunnel, :mod:`.engine_client`) and the choice of a LoRA adapter's upstream
(:mod:`.adapter_resolver`). Who the caller is, the daemon asks :mod:`berth.auth` before a
request reaches the gateway.

May import: :mod:`berth.deployments` (the adapter registry) and every layer below it
(``routing``, ``admission``, ``scaling``, ``observability``, ``http_server``, ``engine_http``,
``store``, the base modules). Never :mod:`berth.admin` or :mod:`berth.daemon`: the daemon
hands the gateway its collaborators.
"""
