"""The agent's redial delay (``berth.backoff.jittered_delay_s`` from the dialer's first
delay): clamped to its cap first, then jittered, so agents that lost the leader together do
not redial together (issue 23: the jitter came first and the clamp after it, so at the cap
half the delays were exactly 30 s).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from berth.agent.dialer import BACKOFF_BASE_S, REDIAL_MAX_S
from berth.backoff import jittered_delay_s
from berth.config import Settings
from berth.errors import ConfigError
from berth.paths import BerthHome

#: Enough redials to sit at any cap tested here (1 s doubled 20 times is past 10^6 s).
AT_THE_CAP = 20


def spread(attempt: int, cap_s: float, draws: int = 10_000) -> list[float]:
    """``draws`` delays for ``attempt`` under ``cap_s``, from a seeded uniform source."""
    rng = random.Random(23)
    return [
        jittered_delay_s(attempt, first_s=BACKOFF_BASE_S, cap_s=cap_s, rand=rng.random)
        for _ in range(draws)
    ]


@pytest.mark.parametrize(
    ("attempt", "rand", "delay_s"),
    [
        (0, 0.0, 0.5),
        (0, 0.5, 0.75),
        (1, 0.0, 1.0),
        (3, 0.5, 6.0),
        (4, 0.0, 8.0),
        (5, 0.0, 15.0),  # 32 s clamped to 30 s, then its lower half kept
        (5, 0.5, 22.5),
        (AT_THE_CAP, 0.0, 15.0),
        (10_000, 0.25, 18.75),  # the exponent is bounded: no overflow on a long outage
    ],
)
def test_the_delay_doubles_is_clamped_then_keeps_half_and_draws_half(
    attempt: int, rand: float, delay_s: float
) -> None:
    assert jittered_delay_s(
        attempt, first_s=BACKOFF_BASE_S, cap_s=REDIAL_MAX_S, rand=lambda: rand
    ) == pytest.approx(delay_s)


@pytest.mark.parametrize("cap_s", [REDIAL_MAX_S, 5.0, 1.0, 300.0])
def test_at_the_cap_delays_are_spread_below_it_and_above_half_of_it(cap_s: float) -> None:
    delays = spread(AT_THE_CAP, cap_s)

    assert max(delays) <= cap_s
    assert min(delays) >= cap_s / 2
    assert sum(delay == cap_s for delay in delays) <= len(delays) // 1000
    # spread over the whole upper half: each tenth of it gets some of them
    tenths = {int((delay - cap_s / 2) / (cap_s / 20)) for delay in delays}
    assert tenths == set(range(10))


@pytest.mark.parametrize("attempt", range(8))
def test_below_the_cap_no_delay_is_above_its_step_or_below_its_floor(attempt: int) -> None:
    step_s = min(REDIAL_MAX_S, 2.0**attempt)

    delays = spread(attempt, REDIAL_MAX_S, draws=2_000)

    assert all(step_s / 2 <= delay < step_s for delay in delays)
    assert min(delays) >= 0.5  # never a burst of redials, even on the first retry


def test_the_cap_is_the_redial_max_s_setting(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "home")

    default = Settings.load(home, env={})
    from_env = Settings.load(home, env={"BERTH_REDIAL_MAX_S": "120"})

    assert default.redial_max_s == REDIAL_MAX_S and default.source("redial_max_s") == "default"
    assert from_env.redial_max_s == 120.0
    with pytest.raises(ConfigError, match="BERTH_REDIAL_MAX_S"):
        Settings.load(home, env={"BERTH_REDIAL_MAX_S": "0.5"})
    # A slip of the keyboard (30000 for 30) would keep a lost agent away for hours.
    with pytest.raises(ConfigError, match="must be at most 3600"):
        Settings.load(home, env={"BERTH_REDIAL_MAX_S": "30000"})
