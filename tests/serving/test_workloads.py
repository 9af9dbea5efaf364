"""Multi-agent workload traces (ccft.serving.workloads): exact lengths, shared prefixes, determinism,
JSONL round trip, dependencies and arrivals, Eq. 9 token counts. Uses the real SmolLM2 tokenizer."""

from __future__ import annotations

import statistics

import pytest

from ccft.core.errors import ConfigError, DataError
from ccft.serving import workloads
from ccft.serving.workloads import KVTokens, Trace, generate, kv_tokens

SMALL = dict(
    sessions=3,
    turns=3,
    shared_tokens=96,
    unique_tokens=24,
    growth_tokens=16,
    max_new_tokens=8,
    rate=2.0,
    seed=0,
)


@pytest.fixture(scope="module")
def react(tokenizer):
    return generate("react", tokenizer=tokenizer, **SMALL)


@pytest.fixture(scope="module")
def reflexion(tokenizer):
    return generate("reflexion", tokenizer=tokenizer, reflection_tokens=12, steps_per_trial=2, **SMALL)


def _record_len(trace: Trace, r) -> int:
    """Tokens appended to the shared context after request r's turn."""
    m = trace.meta
    return m["growth_tokens"] if r.phase == "act" else m["reflection_tokens"]


# ---------------------------------------------------------------- lengths

LENGTHS = [  # (kind, shared, unique, growth): includes lengths shorter than the chat markup
    ("react", 96, 24, 16),
    ("react", 1, 0, 0),
    ("react", 3, 1, 2),
    ("react", 700, 200, 150),
    ("reflexion", 5, 3, 1),
    ("reflexion", 300, 40, 64),
]


@pytest.mark.parametrize("kind,shared,unique,growth", LENGTHS)
def test_lengths_are_exact_in_tokens(tokenizer, kind, shared, unique, growth):
    trace = generate(
        kind,
        sessions=2,
        turns=3,
        shared_tokens=shared,
        unique_tokens=unique,
        growth_tokens=growth,
        max_new_tokens=4,
        rate=None,
        seed=1,
        tokenizer=tokenizer,
    )
    for session in trace.sessions().values():
        expect_shared = shared
        for turn in sorted({r.turn for r in session}):
            reqs = [r for r in session if r.turn == turn]
            for r in reqs:
                assert r.shared_len == expect_shared
                assert r.unique_len == unique
                assert len(r.prompt_ids) == expect_shared + unique == r.prompt_len
                assert len(trace.segments[r.segments[-1]]) == unique  # the request's own segment
            expect_shared += _record_len(trace, reqs[0])
    assert all(len(trace.segments[f"s{s}.ctx"]) == shared for s in range(2))


def test_prompts_end_with_the_assistant_header(react, tokenizer):
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert react.meta["markup"] == "chatml"
    for r in react:
        assert r.prompt_ids[-len(header) :] == header
        assert r.prompt_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_text_is_real_and_decodes(react, tokenizer):
    r = react["s0.t1.math"]
    text = tokenizer.decode(r.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou are one agent of a team")
    assert "Task: " in text and "[math] Math agent" in text and "Turn 0:" in text


# ---------------------------------------------------------------- shared prefix


@pytest.mark.parametrize("name", ["react", "reflexion"])
def test_shared_prefix_is_shared_and_grows(name, request):
    trace = request.getfixturevalue(name)
    for session in trace.sessions().values():
        turns = sorted({r.turn for r in session})
        prev_shared = None
        for turn in turns:
            reqs = [r for r in session if r.turn == turn]
            shared = reqs[0].shared_ids
            assert all(r.shared_ids == shared for r in reqs)  # identical in every agent's prompt
            if len(reqs) > 1:  # unique parts differ between agents
                assert len({tuple(r.unique_ids) for r in reqs}) == len(reqs)
            if prev_shared is not None:
                assert len(shared) > len(prev_shared) and shared[: len(prev_shared)] == prev_shared
            prev_shared = shared


def test_system_prefix_is_common_to_every_session(react):
    firsts = [react[f"s{s}.t0.planner"].prompt_ids[:40] for s in range(SMALL["sessions"])]
    assert all(f == firsts[0] for f in firsts)
    tasks = {tuple(react[f"s{s}.t0.planner"].shared_ids) for s in range(SMALL["sessions"])}
    assert len(tasks) == SMALL["sessions"]  # the task differs per session


def test_react_pattern(react):
    assert react.agents == ["planner", "math", "code", "tools"]
    for session in react.sessions().values():
        assert [r.turn for r in session] == [t for t in range(3) for _ in range(4)]
        assert all(r.phase == "act" for r in session)


def test_reflexion_pattern(reflexion):
    # 3 trials of 2 act turns, a reflection between trials: act act reflect act act reflect act act
    phases = []
    for r in reflexion.sessions()[0]:
        if not phases or phases[-1][0] != r.turn:
            phases.append((r.turn, r.phase, [r.agent]))
        else:
            phases[-1][2].append(r.agent)
    assert [p[1] for p in phases] == ["act", "act", "reflect", "act", "act", "reflect", "act", "act"]
    assert all(p[2] == ["planner"] for p in phases if p[1] == "reflect")
    # the reflection (12 tokens) lands in the shared memory of the next turn
    s0 = reflexion.sessions()[0]
    lens = {r.turn: r.shared_len for r in s0}
    assert lens[3] - lens[2] == 12 and lens[2] - lens[1] == 16


# ---------------------------------------------------------------- dependencies and arrivals


def test_dependencies_and_arrivals(reflexion):
    by_session = reflexion.sessions()
    arrivals = [by_session[s][0].arrival for s in sorted(by_session)]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    for s, reqs in by_session.items():
        assert {r.arrival for r in reqs} == {arrivals[s]}
        for r in reqs:
            if r.turn == 0:
                assert r.depends_on == ()
            else:
                prev = {q.request_id for q in reqs if q.turn == r.turn - 1}
                assert set(r.depends_on) == prev


def test_poisson_arrivals(tokenizer):
    trace = generate(
        "react",
        sessions=400,
        turns=1,
        shared_tokens=4,
        unique_tokens=2,
        growth_tokens=0,
        max_new_tokens=1,
        rate=4.0,
        seed=3,
        tokenizer=tokenizer,
    )
    starts = sorted({r.arrival for r in trace})
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.2)
    closed = generate(
        "react",
        sessions=5,
        turns=1,
        shared_tokens=4,
        unique_tokens=2,
        growth_tokens=0,
        max_new_tokens=1,
        rate=None,
        seed=3,
        tokenizer=tokenizer,
    )
    assert {r.arrival for r in closed} == {0.0}


def test_replay_respects_dependencies_and_arrivals(reflexion):
    replay = reflexion.replay()
    now, running = 0.0, []  # every request takes 0.3 s once released
    released_at, finished_at = {}, {}
    while not replay.done:
        for r in replay.ready(now):
            released_at[r.request_id] = now
            running.append((now + 0.3, r.request_id))
        running.sort()
        candidates = [t for t, _ in running[:1]] + [a for a in [replay.next_arrival()] if a is not None]
        now = max(now, min(candidates))
        while running and running[0][0] <= now:
            _, rid = running.pop(0)
            replay.finish(rid, now)
            finished_at[rid] = now
    assert len(finished_at) == len(reflexion)
    for r in reflexion:
        assert released_at[r.request_id] >= r.arrival
        assert all(released_at[r.request_id] >= finished_at[d] for d in r.depends_on)
    with pytest.raises(ConfigError, match="request_id"):
        replay.finish("s0.t0.math", now)


# ---------------------------------------------------------------- determinism and files


def test_same_seed_same_bytes_different_seed_different(tokenizer, react, tmp_path):
    again = generate("react", tokenizer=tokenizer, **SMALL)
    a = react.save(tmp_path / "a.jsonl").read_bytes()
    b = again.save(tmp_path / "b.jsonl").read_bytes()
    assert a == b
    other = generate("react", tokenizer=tokenizer, **{**SMALL, "seed": 1})
    c = other.save(tmp_path / "c.jsonl").read_bytes()
    assert c != a
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in react]
    assert [r.arrival for r in other] != [r.arrival for r in react]


@pytest.mark.parametrize("name", ["react", "reflexion"])
def test_save_load_round_trip(name, request, tmp_path, tokenizer):
    trace = request.getfixturevalue(name)
    path = trace.save(tmp_path / "trace.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + len(trace.segments) + len(trace)  # meta, segments, one line per request
    loaded = Trace.load(path, tokenizer=tokenizer)
    assert loaded.meta == trace.meta
    assert loaded.segments == trace.segments
    assert [r.record() for r in loaded] == [r.record() for r in trace]
    assert [r.prompt_ids for r in loaded] == [r.prompt_ids for r in trace]
    assert loaded.kv_tokens() == trace.kv_tokens()
    assert loaded.save(tmp_path / "again.jsonl").read_bytes() == path.read_bytes()


def test_save_is_atomic(tmp_path, react, monkeypatch):
    """A save that fails midway leaves the previous file whole and no temporary behind (docs/design.md,
    "Atomic writes")."""
    path = react.save(tmp_path / "t.jsonl")
    before = path.read_bytes()

    def broken(self):
        yield '{"type":"meta"}'
        raise RuntimeError("disk full")

    monkeypatch.setattr(Trace, "lines", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        react.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]


def test_load_errors(tmp_path, react):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "request"}\n')
    with pytest.raises(DataError, match="not a ccft trace"):
        Trace.load(bad)
    with pytest.raises(DataError, match="does not exist"):
        Trace.load(tmp_path / "missing.jsonl")
    lines = react.save(tmp_path / "t.jsonl").read_text().splitlines()
    cut = [ln for ln in lines if '"id":"s0.t0.math"' not in ln]  # drop one segment
    (tmp_path / "cut.jsonl").write_text("\n".join(cut) + "\n")
    with pytest.raises(DataError, match="missing segments"):
        Trace.load(tmp_path / "cut.jsonl")


def test_load_checks_the_tokenizer(tmp_path, react, tokenizer):
    meta = react.meta
    other = Trace({**meta, "tokenizer": {**meta["tokenizer"], "digest": "0" * 64}}, react.segments, [])
    path = other.save(tmp_path / "other.jsonl")
    with pytest.raises(ConfigError, match="tokenizer"):
        Trace.load(path, tokenizer=tokenizer)


# ---------------------------------------------------------------- Eq. 9


def test_eq9_single_turn_by_hand():
    # N=4 agents, L_shared=100, L_unique=10: shared 100 + 4*10 = 140; no-share 4*(100+10) = 440
    assert kv_tokens(4, 100, 10) == KVTokens(140, 440)
    assert kv_tokens(1, 7, 3) == KVTokens(10, 10)
    assert KVTokens(140, 440).ratio == pytest.approx(440 / 140)
    assert KVTokens(140, 440).saving == pytest.approx(300 / 440)
    with pytest.raises(ConfigError, match="n_agents"):
        kv_tokens(0, 1, 1)


def test_eq9_react_trace_by_hand(tokenizer):
    trace = generate(
        "react",
        sessions=1,
        turns=2,
        shared_tokens=100,
        unique_tokens=10,
        growth_tokens=20,
        max_new_tokens=4,
        rate=None,
        seed=0,
        tokenizer=tokenizer,
    )
    # turn 0: L_s=100 -> 100+4*10=140 | 4*110=440; turn 1: L_s=120 -> 120+40=160 | 4*130=520
    assert trace.kv_tokens() == KVTokens(140 + 160, 440 + 520)


def test_eq9_reflexion_trace_by_hand(tokenizer):
    trace = generate(
        "reflexion",
        sessions=2,
        turns=2,
        agents=["planner", "math"],
        shared_tokens=50,
        unique_tokens=5,
        growth_tokens=10,
        reflection_tokens=7,
        max_new_tokens=4,
        rate=None,
        seed=0,
        tokenizer=tokenizer,
    )
    # per session: act (L=50, N=2): 60 | 110; reflect (L=60, N=1): 65 | 65; act (L=67, N=2): 77 | 144
    assert trace.kv_tokens() == KVTokens(2 * (60 + 65 + 77), 2 * (110 + 65 + 144))
    assert workloads.describe(trace)["kv_shared"] == 2 * 202


# ---------------------------------------------------------------- config


def test_agents_and_budgets(tokenizer):
    t = generate(
        "react",
        sessions=1,
        turns=1,
        agents=6,
        shared_tokens=8,
        unique_tokens=4,
        growth_tokens=0,
        max_new_tokens={"planner": 5, "math": 6, "code": 7, "tools": 8, "agent4": 9, "agent5": 10},
        rate=None,
        seed=0,
        tokenizer=tokenizer,
    )
    assert t.agents == ["planner", "math", "code", "tools", "agent4", "agent5"]
    assert [r.max_new_tokens for r in t] == [5, 6, 7, 8, 9, 10]
    t = generate(
        "reflexion",
        sessions=1,
        turns=2,
        agents=["m", "c"],
        shared_tokens=8,
        unique_tokens=4,
        growth_tokens=2,
        max_new_tokens=3,
        rate=None,
        seed=0,
        tokenizer=tokenizer,
    )
    assert [r.agent for r in t if r.phase == "reflect"] == ["m"]  # no planner: the first agent reflects


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"kind": "tot"}, "kind"),
        ({"max_new_tokens": {"planner": 4}}, "max_new_tokens"),
        ({"shared_tokens": 0}, "shared_tokens"),
        ({"agents": ["a", "a"]}, "agents"),
        ({"rate": -1.0}, "rate"),
        ({"steps_per_trial": 2}, "steps_per_trial"),
    ],
)
def test_config_errors_name_the_field(tokenizer, kwargs, field):
    args = {"kind": "react", **SMALL, **kwargs}
    with pytest.raises(ConfigError, match=field):
        generate(tokenizer=tokenizer, **args)
