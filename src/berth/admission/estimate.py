"""Token estimates, for the admission check and for answers without a reported usage.

Where an engine reports ``usage`` berth counts it exactly. The estimates are for two
moments when no count exists:

* **at admission**, before the engine has seen the prompt, the tokens-per-minute check
  reserves :func:`prompt_tokens` of the request body: one token per 4 bytes, rounded up.
  OpenAI's own guide gives "about 4 characters of English text per token"; counting the
  whole body (JSON and all) errs on the high side, and the reservation is settled against
  the real count when the answer ends;
* **an answer without usage** (an engine that reports none, a stream that broke off before
  its usage event, a client that left): the prompt is estimated as above, and the completion
  as :func:`completion_tokens`: one token per event of a stream (engines send one event per
  token generated, plus a few without text, so this errs on the high side), or one token per
  4 bytes of a JSON answer. Such counts are marked estimated in the usage ledger.
"""

from __future__ import annotations

#: Bytes per token of the estimate (OpenAI: about 4 characters of English text per token).
BYTES_PER_TOKEN = 4


def prompt_tokens(request_bytes: int) -> int:
    """The prompt estimate of a request body of ``request_bytes``: 1 token per 4 bytes."""
    return -(-request_bytes // BYTES_PER_TOKEN)


def completion_tokens(*, answer_bytes: int, events: int, streamed: bool) -> int:
    """The completion estimate of an answer: its ``events`` when ``streamed`` (less the
    ``[DONE]`` terminator an OpenAI stream ends with), else 1 token per 4 of its bytes."""
    if streamed:
        return max(0, events - 1)
    return -(-answer_bytes // BYTES_PER_TOKEN)
