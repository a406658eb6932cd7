"""A deployment's wire form (:class:`berth.cluster.protocol.ops.StartArgs`), converted from one
definition at both ends: the leader's :meth:`~StartArgs.from_request` and the agent's
:meth:`~StartArgs.to_request`, through the real ``start`` op's JSON."""

from __future__ import annotations

import json
from pathlib import Path

from berth.cluster.protocol.ops import START, StartArgs
from berth.vocab.deployment_request import DeploymentRequest


def over_the_wire(request: DeploymentRequest) -> tuple[dict[str, object], DeploymentRequest]:
    """The ``start`` arguments' JSON the leader sends for ``request``, and what the agent
    makes of them."""
    raw = START.encode_args(StartArgs.from_request(request, health_timeout_s=42.0))
    received = START.decode_args(raw)
    assert received.health_timeout_s == 42.0
    return json.loads(bytes(raw)), received.to_request()


def test_a_plain_deployment_arrives_whole_and_sends_no_adapter_fields() -> None:
    request = DeploymentRequest(
        deployment_id="d-1",
        model_name="tiny",
        model_path=Path("/models/tiny.gguf"),
        engine="llamacpp",
        port=0,
        log_path=Path(),
        gpus=(0, 1),
        ctx=4096,
        extra_args=("--flash-attn",),
        served_model_name="tiny-chat",
        runtime="docker",
        image="ghcr.io/example/llama:1",
        max_lora_rank=64,  # not sent: the request uses no adapters
    )
    wire, received = over_the_wire(request)
    assert not {"adapter_slots", "max_lora_rank", "lora_target_modules", "lora_files"} & set(wire)
    assert received == DeploymentRequest(**{**request.__dict__, "max_lora_rank": None})


def test_a_deployment_with_adapters_arrives_whole() -> None:
    request = DeploymentRequest(
        deployment_id="d-2",
        model_name="base",
        model_path=Path("/models/base"),
        engine="vllm",
        port=0,
        log_path=Path(),
        adapter_slots=4,
        max_lora_rank=32,
        lora_target_modules=("q_proj", "v_proj"),
        lora_files=(Path("/adapters/a.gguf"),),
    )
    wire, received = over_the_wire(request)
    assert wire["adapter_slots"] == 4 and wire["lora_files"] == ["/adapters/a.gguf"]
    assert received == request
    assert received.uses_adapters
