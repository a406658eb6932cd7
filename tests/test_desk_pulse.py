"""The desk worker's pure decisions: pulse contents, when a pulse is due, backoff, ids."""

from __future__ import annotations

import pytest

from berth.backoff import Backoff
from berth.desk.errors import DeskProtocolError
from berth.desk.leader import job_request, speed_test_request
from berth.desk.pulse import (
    GpuView,
    ModelServing,
    SentPulse,
    build_pulse,
    is_busy,
    pulse_due,
    serving_of,
    tokens_per_second,
)
from berth.desk.wire import ClaimedJob, Pulse, decode, encode, is_model_id, is_node_secret


def gpu(node: str, index: int, name: str = "NVIDIA H200", total: int = 143771, used: int = 0):
    return GpuView(node_id=node, index=index, name=name, memory_total_mb=total, memory_used_mb=used)


def test_no_gpu_gives_null_hardware_fields() -> None:
    serving = serving_of("smollm2", slots=1, in_flight=0, gpus=[])
    assert (serving.chip, serving.vram_gb, serving.vram_used_gb) == (None, None, None)


def test_gpus_are_summed_once_each_and_named_by_their_distinct_names() -> None:
    serving = serving_of(
        "qwen",
        slots=3,
        in_flight=1,
        gpus=[
            gpu("local", 0, used=20480),
            gpu("local", 0, used=20480),  # a second deployment on the same GPU
            gpu("gpu-a", 0, "NVIDIA L4", 23034, 1024),
        ],
    )
    assert serving.chip == "NVIDIA H200 + NVIDIA L4"
    assert serving.vram_gb == round((143771 + 23034) / 1024, 1)
    assert serving.vram_used_gb == 21.0


@pytest.mark.parametrize(
    ("in_flight", "own", "slots", "busy"),
    [
        (0, 0, 1, False),
        (1, 0, 1, True),
        (0, 1, 1, True),
        (1, 1, 2, False),
        (3, 0, 2, True),
        (0, 0, 0, True),
    ],
)
def test_busy_when_the_slots_are_full(in_flight: int, own: int, slots: int, busy: bool) -> None:
    serving = serving_of("m", slots=slots, in_flight=in_flight, gpus=[])
    assert is_busy(serving, own) is busy


def test_a_pulse_carries_every_field_of_the_protocol() -> None:
    serving = ModelServing("m", 2, 0, chip="NVIDIA H200", vram_gb=140.4, vram_used_gb=3.0)
    pulse = build_pulse(serving, own_jobs=1, tok_per_s=None, models=["m", "n"], enc_pubkey="K")
    assert decode(encode(pulse), dict[str, object], call="test") == {
        "chip": "NVIDIA H200",
        "vram_gb": 140.4,
        "vram_used_gb": 3.0,
        "tok_per_s": None,
        "busy": False,
        "slots": 2,
        "models": ["m", "n"],
        "enc_pubkey": "K",
    }


def _pulse(busy: bool = False, models: tuple[str, ...] = ("m",)) -> Pulse:
    return Pulse(None, None, None, None, busy, 1, list(models), "K")


@pytest.mark.parametrize(
    ("last", "pulse", "now", "due"),
    [
        (None, _pulse(), 0.0, True),
        (SentPulse(0.0, False, ("m",)), _pulse(), 29.0, False),
        (SentPulse(0.0, False, ("m",)), _pulse(), 30.0, True),
        (SentPulse(0.0, False, ("m",)), _pulse(busy=True), 1.0, True),
        (SentPulse(0.0, False, ("m",)), _pulse(models=("m", "n")), 1.0, True),
    ],
)
def test_a_pulse_is_due_on_change_or_every_30_s(
    last: SentPulse | None, pulse: Pulse, now: float, due: bool
) -> None:
    assert pulse_due(last, pulse, now) is due


@pytest.mark.parametrize(
    ("tokens", "wall_s", "speed"), [(16, 0.5, 32.0), (10, 3.0, 3.3), (0, 1.0, None), (5, 0.0, None)]
)
def test_speed_is_completion_tokens_over_wall_time(
    tokens: int, wall_s: float, speed: float | None
) -> None:
    assert tokens_per_second(tokens, wall_s) == speed


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    backoff = Backoff(2.0, 60.0, rand=lambda: 1.0)  # the top of each step
    assert [backoff.next_delay_s() for _ in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    backoff.reset()
    assert backoff.next_delay_s() == 2.0
    for _ in range(2000):  # no overflow however long the desk stays down
        backoff.next_delay_s()
    assert backoff.next_delay_s() == 60.0


def test_backoff_jitters_in_the_upper_half() -> None:
    lowest = Backoff(2.0, 60.0, rand=lambda: 0.0)
    middle = Backoff(2.0, 60.0, rand=lambda: 0.5)
    assert [lowest.next_delay_s(), lowest.next_delay_s()] == [1.0, 2.0]
    assert [middle.next_delay_s(), middle.next_delay_s()] == [1.5, 3.0]


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("qwen2.5:7b", True),
        ("org/model-Q4_K_M.gguf", True),
        ("a" * 80, True),
        ("a" * 81, False),
        ("", False),
        ("has space", False),
        ("émoji", False),
        ("x\n", False),
    ],
)
def test_model_ids_follow_the_protocols_pattern(name: str, valid: bool) -> None:
    assert is_model_id(name) is valid


@pytest.mark.parametrize(
    ("secret", "valid"),
    [
        ("sk-node-" + "a" * 32, True),
        ("sk-node-" + "_-Az09" * 5 + "ab", True),
        ("sk-node-" + "a" * 31, False),
        ("sk-node-" + "a" * 33, False),
        ("sk-" + "a" * 32, False),
    ],
)
def test_node_secrets_follow_the_protocols_pattern(secret: str, valid: bool) -> None:
    assert is_node_secret(secret) is valid


def test_a_job_request_is_the_protocols_and_a_pool_test_adds_limits() -> None:
    plain = decode(encode(job_request("m", "P", pool_test=False)), dict[str, object], call="t")
    assert plain == {"model": "m", "messages": [{"role": "user", "content": "P"}], "stream": False}
    check = decode(encode(job_request("m", "P", pool_test=True)), dict[str, object], call="t")
    assert check == {**plain, "max_tokens": 512, "temperature": 0.0}
    speed = decode(encode(speed_test_request("m")), dict[str, object], call="t")
    assert speed == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "stream": False,
    }


@pytest.mark.parametrize(
    "body", [b"{not json", b"[]", b'{"model": "m"}', b'{"id": 5, "model": "m"}', b""]
)
def test_a_malformed_claim_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(DeskProtocolError):
        decode(body, ClaimedJob, call="jobs/claim")


def test_a_sealed_job_without_enc_or_with_an_unknown_mode_is_a_protocol_error() -> None:
    sealed = decode(
        b'{"id": "job_1", "model": "m", "prompt_mode": "sealed"}', ClaimedJob, call="jobs/claim"
    )
    with pytest.raises(DeskProtocolError, match="sealed without enc"):
        sealed.sealed_prompt()
    odd = decode(
        b'{"id": "job_2", "model": "m", "prompt_mode": "rot13"}', ClaimedJob, call="jobs/claim"
    )
    with pytest.raises(DeskProtocolError, match="unknown prompt_mode"):
        odd.mode()
    broken = decode(
        b'{"id": "job_3", "model": "m", "prompt_mode": "sealed", "enc": {"x": 1}}',
        ClaimedJob,
        call="jobs/claim",
    )
    with pytest.raises(DeskProtocolError):
        broken.sealed_prompt()
