"""What an engine says of its own prefix cache, and how that corrects the prefix record (pure).

The prefix policy's record (:mod:`berth.routing.prefix_index`) is berth's estimate of what
each engine holds. Where the engine reports on its cache, the probe cycle reads it
(:mod:`berth.routing.cache_probe`) and the estimate is corrected with what is parsed here:

- llama.cpp, ``GET /slots`` (on by default; ``--no-slots`` turns it off): a JSON array, one
  object per slot, each with ``id``, ``n_ctx`` and, once the slot has served a task,
  ``id_task`` and ``n_prompt_tokens`` (the tokens its cache holds now; read from llama.cpp's
  ``server_slot::to_json``, tools/server/server-context.cpp, and a real llama-server's
  answer). Its ``--cache-ram`` prompt cache keeps evicted prompts in host memory, so the sum
  of the slots' ``n_ctx`` is no bound on what it can serve from cache: no capacity is given.
- vLLM, ``GET /metrics``: ``vllm:prompt_tokens_total`` (a counter), ``vllm:kv_cache_usage_perc``
  (``vllm:gpu_cache_usage_perc`` before v1), the prefix cache counters
  ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (v1) or the gauge
  ``vllm:gpu_prefix_cache_hit_rate``, and ``vllm:cache_config_info``, whose labels
  ``num_gpu_blocks`` x ``block_size`` are its cache's capacity in tokens.
- SGLang, ``GET /metrics``: ``sglang:prompt_tokens_total``, ``sglang:token_usage``,
  ``sglang:cache_hit_rate`` and ``sglang:max_total_num_tokens`` (the capacity in tokens).

The corrections (:func:`correct`), in the order they are checked:

1. The engine restarted: the number that only grows while it runs (llama.cpp's largest
   ``id_task``; the engines' ``prompt_tokens_total``) went down since the last reading. Its
   cache is empty: every entry of it goes.
2. The engine holds nothing: no slot holds a token (llama.cpp), or it has processed no
   prompt token since it started (vLLM, SGLang). Every entry goes, but only while no request
   is in flight on it (one just sent may not have reached a slot yet).
3. Its capacity is known: the record keeps at most as many of its blocks as that many
   tokens fill (:data:`~berth.routing.prefix_blocks.CHARS_PER_TOKEN` bytes a token,
   :data:`~berth.routing.prefix_blocks.BLOCK_BYTES` a block), its least recently served
   going first.

The KV cache usage is shown, never acted on: both engines count only the blocks running
requests hold, so an idle engine reads about 0 with its prefix cache full (vLLM's freed
blocks stay cached until reused; SGLang's evictable radix nodes are left out of it).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from berth.routing.errors import EngineSignalError
from berth.routing.prefix_blocks import BLOCK_BYTES, CHARS_PER_TOKEN

#: Where a signal came from, as ``berth routing`` shows it.
SignalSource = Literal["llama.cpp /slots", "vLLM /metrics", "SGLang /metrics"]

#: The path read per engine kind (an adopted endpoint's engine is unknown: none is read).
SIGNAL_PATHS: dict[str, tuple[str, SignalSource]] = {
    "llamacpp": ("/slots", "llama.cpp /slots"),
    "vllm": ("/metrics", "vLLM /metrics"),
    "sglang": ("/metrics", "SGLang /metrics"),
}


@dataclass(frozen=True)
class CacheSignal:
    """One reading of an engine's cache.

    ``cached_tokens``: tokens its slots hold now (llama.cpp; ``None``: not reported);
    ``served_tokens``: the prompt tokens it has processed since it started (vLLM, SGLang);
    ``epoch``: a number that only grows while the engine runs (a lower one means it
    restarted); ``capacity_tokens``: its KV cache's size in tokens, when known;
    ``usage``: the fraction of its KV cache in use (0-1); ``hit_rate``: its prefix cache hit
    rate (0-1, since it started); ``slots``: how many slots it listed (llama.cpp).
    """

    source: SignalSource
    cached_tokens: int | None = None
    served_tokens: int | None = None
    epoch: int | None = None
    capacity_tokens: int | None = None
    usage: float | None = None
    hit_rate: float | None = None
    slots: int | None = None

    @property
    def holds_nothing(self) -> bool:
        """Whether the engine says its cache is empty (correction 2)."""
        if self.cached_tokens is not None:
            return self.cached_tokens == 0
        return self.served_tokens == 0

    def describe(self) -> str:
        """In words, for ``berth routing``: ``llama.cpp /slots: 1,532 tokens cached in 2
        slots``."""
        parts: list[str] = []
        if self.cached_tokens is not None:
            held = f"{self.cached_tokens:,} tokens cached"
            parts.append(held + (f" in {self.slots} slots" if self.slots is not None else ""))
        if self.usage is not None:
            parts.append(f"KV cache {self.usage:.0%} in use")
        if self.hit_rate is not None:
            parts.append(f"prefix hit rate {self.hit_rate:.0%}")
        if self.capacity_tokens is not None:
            parts.append(f"capacity {self.capacity_tokens:,} tokens")
        if self.served_tokens is not None:
            parts.append(f"{self.served_tokens:,} prompt tokens served")
        return f"{self.source}: " + (", ".join(parts) if parts else "nothing reported")


@dataclass(frozen=True)
class Correction:
    """What a reading does to a deployment's record: ``drop`` every entry, or keep at most
    ``cap_blocks`` (``None``: no cap); ``reason`` in words (``""``: nothing to correct)."""

    drop: bool = False
    cap_blocks: int | None = None
    reason: str = ""


def parse_slots(body: bytes) -> CacheSignal:
    """A llama.cpp ``GET /slots`` answer (see the module docstring) as a signal. Raises
    :class:`EngineSignalError` for anything that is not a JSON array of slot objects."""
    try:
        slots = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineSignalError(f"/slots is not JSON ({exc})") from exc
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        raise EngineSignalError("/slots is not a list of slot objects")
    cached = 0
    tasks: list[int] = []
    for slot in slots:
        tokens = slot.get("n_prompt_tokens", 0)
        task = slot.get("id_task")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise EngineSignalError(f"/slots: slot {slot.get('id')} has n_prompt_tokens {tokens!r}")
        cached += tokens
        if isinstance(task, int) and not isinstance(task, bool):
            tasks.append(task)
    return CacheSignal(
        "llama.cpp /slots",
        cached_tokens=cached,
        epoch=max(tasks) if tasks else None,
        slots=len(slots),
    )


def parse_metrics(engine: Literal["vllm", "sglang"], text: str) -> CacheSignal:
    """A vLLM or SGLang ``GET /metrics`` answer (Prometheus text) as a signal; a metric the
    engine's version lacks is left ``None``. Raises :class:`EngineSignalError` for text
    that is not Prometheus' format, or that has none of the engine's metrics."""
    prefix = "vllm:" if engine == "vllm" else "sglang:"
    values: dict[str, float] = {}
    labels: dict[str, Mapping[str, str]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith(prefix):
                    # Summed over label sets (one per served model name or engine index).
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
                    labels[sample.name] = sample.labels
    except ValueError as exc:
        raise EngineSignalError(f"/metrics is not Prometheus text ({exc})") from exc
    if not values:
        raise EngineSignalError(f"/metrics has no {prefix} metrics")
    if engine == "vllm":
        return _vllm(values, labels)
    return _sglang(values)


def _vllm(values: Mapping[str, float], labels: Mapping[str, Mapping[str, str]]) -> CacheSignal:
    served = _first(values, ("vllm:prompt_tokens_total",))
    usage = _first(values, ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
    hits = values.get("vllm:prefix_cache_hits_total")
    queries = values.get("vllm:prefix_cache_queries_total")
    if hits is not None and queries:
        hit_rate: float | None = hits / queries
    else:
        hit_rate = _first(values, ("vllm:gpu_prefix_cache_hit_rate",))
    capacity = None
    config = labels.get("vllm:cache_config_info", {})
    # Absent from some versions, or "None" before the cache is sized: no capacity then.
    with contextlib.suppress(KeyError, ValueError):
        capacity = int(config["num_gpu_blocks"]) * int(config["block_size"])
    return CacheSignal(
        "vLLM /metrics",
        served_tokens=_whole(served),
        epoch=_whole(served),
        capacity_tokens=capacity,
        usage=usage,
        hit_rate=hit_rate,
    )


def _sglang(values: Mapping[str, float]) -> CacheSignal:
    served = _first(values, ("sglang:prompt_tokens_total",))
    return CacheSignal(
        "SGLang /metrics",
        served_tokens=_whole(served),
        epoch=_whole(served),
        capacity_tokens=_whole(_first(values, ("sglang:max_total_num_tokens",))),
        usage=_first(values, ("sglang:token_usage",)),
        hit_rate=_first(values, ("sglang:cache_hit_rate",)),
    )


def _first(values: Mapping[str, float], names: Iterable[str]) -> float | None:
    return next((values[n] for n in names if n in values), None)


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def capacity_blocks(capacity_tokens: int) -> int:
    """How many prompt blocks ``capacity_tokens`` tokens hold, by the record's estimate of
    bytes a token (at least 1)."""
    return max(1, capacity_tokens * CHARS_PER_TOKEN // BLOCK_BYTES)


def correct(previous: CacheSignal | None, current: CacheSignal, *, in_flight: int) -> Correction:
    """What ``current`` (after ``previous``, the deployment's last reading, if any) does to
    the deployment's record, with ``in_flight`` requests on it now (the module docstring's
    rules, in order)."""
    cap = None if current.capacity_tokens is None else capacity_blocks(current.capacity_tokens)
    if (
        previous is not None
        and previous.epoch is not None
        and current.epoch is not None
        and current.epoch < previous.epoch
    ):
        what = "largest task id" if current.source == "llama.cpp /slots" else "prompt tokens"
        return Correction(
            True,
            cap,
            f"the engine restarted ({what} fell from {previous.epoch:,} to "
            f"{current.epoch:,}): its cache is empty",
        )
    if current.holds_nothing and in_flight == 0:
        return Correction(True, cap, "the engine holds no cached prompt tokens")
    if cap is not None:
        return Correction(False, cap, f"at most {cap:,} blocks (its cache's capacity)")
    return Correction()
