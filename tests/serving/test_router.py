"""Routers (ccft.serving.router): session affinity with a load-aware fallback (the ``session`` router, and the
``prefix`` router, which keeps its guarantees), least-loaded, round-robin, the registry and its errors. Pure
Python. The ``prefix`` router's own placement by blocks: test_prefix_router.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ccft.core.errors import ConfigError
from ccft.serving.router import (
    ROUTERS,
    LeastLoadedRouter,
    PrefixRouter,
    RoundRobinRouter,
    Router,
    SessionAffinityRouter,
    WorkerState,
    make_router,
    worker_loads,
)

PROMPT = [1, 2, 3]


def loads(*values):
    return [WorkerState(active=v) for v in values]


def test_worker_state_forms():
    states = [WorkerState(queued=1, active=2), {"queued": 4}, 5, SimpleNamespace(queued=0, active=6)]
    assert worker_loads(states) == [3, 4, 5, 6]
    with pytest.raises(ConfigError, match="workers_state"):
        worker_loads([])
    with pytest.raises(ConfigError, match="workers_state"):
        worker_loads(["busy"])


def test_new_session_goes_to_least_loaded_lowest_index():
    r = SessionAffinityRouter()
    assert r.place("a", PROMPT, loads(3, 1, 1, 2)) == 1
    assert r.place("b", PROMPT, loads(0, 0, 0)) == 0


def test_affinity_is_kept_under_moderate_imbalance():
    r = SessionAffinityRouter()
    assert r.place("s", PROMPT, loads(0, 0)) == 0
    # home busier but within the gap: stays home every time
    for state in (loads(1, 0), loads(3, 0), loads(6, 3), loads(10, 5)):
        assert r.place("s", PROMPT, state) == 0
    assert r.stats() == {"new": 1, "affinity": 4, "fallback": 0, "sessions": 1}


# (home load, least load, moves?) with the defaults max_load_ratio=2.0, min_load_gap=4:
# a move needs home - least >= 4 AND home > 2 * least.
THRESHOLDS = [
    (3, 0, False),
    (4, 0, True),  # gap decides at an idle worker
    (6, 3, False),
    (7, 3, True),  # gap 3 -> no; gap 4 and 7 > 6 -> yes
    (10, 5, False),
    (11, 5, True),  # ratio decides: 10 is not > 2*5
    (40, 20, False),
    (41, 20, True),
]


@pytest.mark.parametrize("cls", [SessionAffinityRouter, PrefixRouter])
@pytest.mark.parametrize("home,least,moves", THRESHOLDS)
def test_fallback_triggers_at_the_threshold(home, least, moves, cls):
    r = cls()
    assert r.place("s", PROMPT, loads(0, 0, 0)) == 0
    state = loads(home, least + 1, least)  # worker 2 is the least loaded
    assert r.place("s", PROMPT, state) == (2 if moves else 0)
    assert r.stats()["fallback"] == int(moves)
    # after a move the session is pinned to its new worker
    assert r.place("s", PROMPT, loads(home, least + 1, least)) == (2 if moves else 0)


def test_custom_thresholds():
    r = SessionAffinityRouter(max_load_ratio=1.0, min_load_gap=1)
    r.place("s", PROMPT, loads(0, 0))
    assert r.place("s", PROMPT, loads(1, 1)) == 0
    assert r.place("s", PROMPT, loads(2, 1)) == 1
    with pytest.raises(ConfigError, match="max_load_ratio"):
        SessionAffinityRouter(max_load_ratio=0.5)
    with pytest.raises(ConfigError, match="min_load_gap"):
        SessionAffinityRouter(min_load_gap=0)


@pytest.mark.parametrize("cls", [SessionAffinityRouter, PrefixRouter])
def test_sessions_are_independent_and_forgotten_when_done(cls):
    r = cls()
    assert r.place("a", PROMPT, loads(0, 0)) == 0
    assert r.place("b", PROMPT, loads(1, 0)) == 1
    assert r.place("a", PROMPT, loads(1, 1)) == 0
    assert r.place("b", PROMPT, loads(1, 1)) == 1
    r.on_finish("a", 0)
    assert r.placement == {"a": 0, "b": 1}
    r.on_finish("a", 0, session_done=True)
    assert "a" not in r.placement
    assert r.place("a", PROMPT, loads(2, 1)) == 1  # placed as new: least loaded
    assert r.place("c", PROMPT, loads(0)) == 0
    # fewer workers than the remembered index: placed as new
    assert r.place("b", PROMPT, loads(0)) == 0


def test_least_loaded_router():
    r = LeastLoadedRouter()
    assert r.place("a", PROMPT, loads(2, 1, 1)) == 1
    assert r.place("a", PROMPT, loads(0, 1, 1)) == 0  # no affinity
    assert r.place("x", PROMPT, [WorkerState(queued=2), WorkerState(active=1, queued=1), 1]) == 2


def test_round_robin_router():
    r = RoundRobinRouter()
    assert [r.place("s", PROMPT, loads(9, 0, 0)) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert r.place("s", PROMPT, loads(0, 0)) == 0  # wraps to the current worker count


def test_registry_and_unknown_name():
    assert set(ROUTERS) == {"session", "prefix", "round-robin", "least-loaded"}
    assert isinstance(make_router("prefix", block_tokens=8), PrefixRouter)
    assert isinstance(make_router("session", min_load_gap=2), SessionAffinityRouter)
    assert all(isinstance(make_router(name), Router) for name in ROUTERS)
    with pytest.raises(ConfigError) as err:
        make_router("random")
    msg = str(err.value)
    assert "router" in msg and "'random'" in msg
    assert all(name in msg for name in ("session", "prefix", "round-robin", "least-loaded"))
    with pytest.raises(ConfigError, match="router"):
        ROUTERS["sticky"]
    with pytest.raises(ConfigError, match="does not take options"):
        make_router("round-robin", min_load_gap=2)
