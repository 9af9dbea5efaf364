"""MLFQ scheduling policy (issue #15 item 4): outputs do not depend on the policy, a short request submitted
behind long ones finishes first under MLFQ and not under FCFS, and aging bounds how long a long request
waits (counted in scheduler steps, never wall time)."""

from __future__ import annotations

import pytest

import ccft
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from ccft.serving import PrefixKVStore
from ccft.serving.policies import FCFS, MLFQ
from ccft.serving.scheduler import Scheduler, ServeRequest
from conftest import make_lora, make_tiny_folder


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    base = ccft.load_base(
        str(make_tiny_folder(tmp_path_factory.mktemp("mlfq"), tokenizer, seed=5, scale=30.0))
    )
    full = ccft.make_decoder(base, "full", method="ccft")
    full.model.eval()
    return base, {
        "full": full,
        **{name: make_lora(base, name, 40 + i, 4) for i, name in enumerate(("math", "code"))},
    }


@pytest.fixture(scope="module")
def texts(gsm8k_rows, tokenizer):
    return [tokenize_prompt(tokenizer, r["prompt"], chat_template=False)[:24] for r in gsm8k_rows[200:240]]


def _reference(world, r):
    base, decs = world
    if r.decoder == "base":
        return ccft.generate([list(r.prompt_ids)], mode="base", base=base, max_new_tokens=r.max_new_tokens)[0]
    return ccft.generate(
        [list(r.prompt_ids)], mode="prefillshare", decoder=decs[r.decoder], max_new_tokens=r.max_new_tokens
    )[0]


class StepClock:
    """Runs a scheduler to idle and records at which step each ticket ended."""

    def __init__(self, sched):
        self.sched, self.now, self.ended = sched, 0, {}

    def submit(self, r):
        return self.sched.submit(r, on_done=lambda t: self.ended.setdefault(t.id, self.now))

    def step(self):
        self.now += 1
        self.sched.step()

    def run(self, limit=10_000):
        while not self.sched.idle() and self.now < limit:
            self.step()


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_outputs_do_not_depend_on_the_policy(world, texts, decode):
    """Every request (4 decoders, 2 shared contexts, varied output lengths) equals offline ccft.generate under
    MLFQ with preemption (max_running=2 of 8 active: rows paused and resumed), as under FCFS."""
    base, decs = world
    reqs = []
    for c in range(2):
        for j, d in enumerate(("base", "math", "code", "full")):
            reqs.append(
                ServeRequest(d, texts[c] + texts[10 + j][: 3 + j], shared_len=24, max_new_tokens=3 + 5 * j)
            )
    want = [list(_reference(world, r).token_ids) for r in reqs]
    for policy in ("fcfs", "mlfq"):
        eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=float("nan"))
        sched = Scheduler(
            eng,
            store=PrefixKVStore(block_tokens=8),
            policy=policy,
            max_running=2,
            mlfq_quantum=2,
            mlfq_aging_steps=5,
        )
        tickets = [sched.submit(r) for r in reqs]
        sched.run_until_idle()
        assert [t.tokens for t in tickets] == want, policy
        assert sched.live_bytes == 0 and eng.active == 0 and eng.arena.used_tokens == 0
        if policy == "mlfq":
            assert sched.counters["mlfq_demotions"] > 0


def _short_behind_long(world, texts, policy):
    base, decs = world
    sched = Scheduler(
        SharedPrefillEngine(base, decoders=decs, max_batch=4), policy=policy, max_running=2, mlfq_quantum=4
    )
    clock = StepClock(sched)
    longs = [
        clock.submit(ServeRequest(d, texts[i], max_new_tokens=30)) for i, d in enumerate(("math", "code"))
    ]
    for _ in range(6):
        clock.step()
    short = clock.submit(ServeRequest("math", texts[5], max_new_tokens=3))
    clock.run()
    for t in longs + [short]:
        assert t.tokens == list(_reference(world, t.request).token_ids)
        assert len(t.tokens) == t.request.max_new_tokens  # no early EOS: the step counts below hold
    return [clock.ended[t.id] for t in longs], clock.ended[short.id]


def test_short_request_behind_long_ones_finishes_first_under_mlfq(world, texts):
    longs, short = _short_behind_long(world, texts, "fcfs")
    assert longs == [30, 30] and short == 33  # FCFS: waits for a long request's slot, then 3 steps
    longs, short = _short_behind_long(world, texts, "mlfq")
    # MLFQ: both long requests were demoted after 4 tokens; the short one enters the top level, is admitted
    # into a free engine slot and preempts one of them: its 3 tokens in steps 7-9
    assert short == 9 and min(longs) > short and max(longs) == 33


def _long_under_a_stream_of_short_ones(world, texts, aging_steps, steps):
    base, decs = world
    sched = Scheduler(
        SharedPrefillEngine(base, decoders=decs, max_batch=32),
        policy="mlfq",
        max_running=1,
        mlfq_quantum=4,
        mlfq_aging_steps=aging_steps,
    )
    clock = StepClock(sched)
    long = clock.submit(ServeRequest("code", texts[0], max_new_tokens=20))
    shorts = []
    while clock.now < steps and long.id not in clock.ended:
        if len(shorts) < 30:  # a new short request every step: more work than one row per step can serve
            shorts.append(clock.submit(ServeRequest("math", texts[1 + len(shorts) % 30], max_new_tokens=2)))
        clock.step()
    return clock, long, shorts


def test_aging_prevents_starvation(world, texts):
    aging, quantum, n = 8, 4, 20
    clock, long, shorts = _long_under_a_stream_of_short_ones(world, texts, aging, 200)
    # its first quantum at once, then every aging period it is promoted and runs one top-level quantum
    bound = quantum + -(-(n - quantum) // quantum) * (aging + quantum)
    assert long.id in clock.ended and clock.ended[long.id] <= bound
    assert clock.sched.counters["mlfq_promotions"] >= (n - quantum) // quantum
    clock.run()
    assert long.tokens == list(_reference(world, long.request).token_ids)
    assert all(t.tokens == list(_reference(world, t.request).token_ids) for t in shorts[:3])
    # without aging (a period longer than the run), the same stream starves it
    starved, long2, _ = _long_under_a_stream_of_short_ones(world, texts, 10_000, bound + 10)
    assert long2.id not in starved.ended and len(long2.tokens) == quantum


def test_workload_varied_output_lengths_and_eight_agents(tokenizer):
    """``new_tokens_spread`` varies each call's budget (seeded, its own stream: the prompts are unchanged);
    ``EIGHT_AGENTS`` are the four default roles and four more, each with its own instruction."""
    from ccft.core.errors import ConfigError
    from ccft.serving import workloads

    kw = dict(
        sessions=3,
        turns=2,
        agents=list(workloads.EIGHT_AGENTS),
        shared_tokens=64,
        unique_tokens=24,
        growth_tokens=8,
        max_new_tokens=16,
        rate=None,
        seed=3,
        tokenizer=tokenizer,
    )
    fixed = workloads.generate("react", **kw)
    varied = workloads.generate("react", new_tokens_spread=0.8, **kw)
    again = workloads.generate("react", new_tokens_spread=0.8, **kw)
    assert {r.max_new_tokens for r in fixed} == {16}
    lengths = [r.max_new_tokens for r in varied]
    assert lengths == [r.max_new_tokens for r in again] and len(set(lengths)) > 5 and min(lengths) >= 1
    assert [r.prompt_ids for r in varied] == [r.prompt_ids for r in fixed]
    assert varied.agents == ["planner", "math", "code", "tools", "critic", "search", "writer", "verifier"]
    uniques = {tuple(r.unique_ids) for r in fixed if r.session == 0 and r.turn == 0}
    assert len(uniques) == 8
    assert varied.meta["new_tokens_spread"] == 0.8
    with pytest.raises(ConfigError, match="new_tokens_spread"):
        workloads.generate("react", new_tokens_spread=-1, **kw)


class NewestFirst(FCFS):
    """A custom request-queue policy (a subclass, as a user writes one): the newest queued request first."""

    name = "newest-first"

    def next_to_admit(self, queue):
        return max(queue, key=lambda t: t.id) if queue else None


def test_a_policy_object_decides_admission_order_and_nothing_else(world, texts):
    """Scheduler(policy=<object>): with one slot, the policy alone orders admission; outputs stay the
    reference."""
    base, decs = world
    sched = Scheduler(SharedPrefillEngine(base, decoders=decs, max_batch=1), policy=NewestFirst())
    clock = StepClock(sched)
    tickets = [clock.submit(ServeRequest("math", texts[i], max_new_tokens=3)) for i in range(3)]
    clock.run()
    assert sorted(clock.ended, key=clock.ended.get) == [tickets[2].id, tickets[1].id, tickets[0].id]
    assert sched.policy == "newest-first" and sched.stats()["policy"] == "newest-first"
    for t in tickets:
        assert t.state == "done" and t.tokens == list(_reference(world, t.request).token_ids)


def test_mlfq_state_lives_in_the_policy():
    """Entry level by prompt length (skip-join), demotion after the quantum, promotion after aging."""
    from types import SimpleNamespace

    p = MLFQ(levels=3, quantum=2, entry_tokens=4, aging_steps=3)
    short, long = (
        SimpleNamespace(id=i, request=SimpleNamespace(prompt_ids=[0] * n)) for i, n in ((0, 4), (1, 9))
    )
    for t in (short, long):
        p.on_submit(t)
    assert (p.level(short), p.level(long)) == (0, 2)  # 9 > 4, 9 > 8: two levels skipped
    p.after_step([short, long], {short.id})
    p.after_step([short, long], {short.id})
    assert p.level(short) == 1 and p.counters["mlfq_demotions"] == 1
    p.after_step([short, long], {short.id})  # the long one waited 3 steps unstepped: promoted to the top
    assert p.level(long) == 0 and p.counters["mlfq_promotions"] == 1
    assert p.next_to_admit([long, short]) is long  # level 0 (promoted) before level 1
    p.forget(short)
    assert p.order(short) == (0, short.id)  # no state left for an ended request
