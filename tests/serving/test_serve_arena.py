"""``ccft serve --max-prefix-tokens N|budget``: the prefix arena allocated whole at start
(``build_scheduler``, the one rule for the single engine and every Ray replica).

``budget`` sizes it from ``--kv-budget-mb`` (budget bytes ÷ KV bytes per token); requests that make the
default arena double leave a fixed one as it was, with greedy tokens identical to the default path's; a
context the arena has no room for now waits for live ones to end, one longer than the whole arena fails as
at any full arena (CapacityError); bad values are refused naming the flag.
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.cli.main import build_parser
from ccft.cli.serve import build_scheduler
from ccft.serving import ServeRequest
from conftest import make_lora, make_tiny_folder

N_NEW = 6
PER_TOKEN = (
    2 * 2 * 2 * 16 * 4
)  # the tiny model's KV bytes per token: layers × (K, V) × kv_heads × head_dim × 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("serve_arena")
    model = make_tiny_folder(root / "base", tokenizer, seed=11, scale=30.0)
    base = ccft.load_base(str(model))
    math = ccft.save_decoder(make_lora(base, "math", 40, 4), root / "math")
    return str(model), str(math)


def _scheduler(folders, *options):
    model, math = folders
    args = build_parser().parse_args(["serve", "--model", model, "--decoder", f"math={math}", *options])
    return build_scheduler(args)[0]


def _ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _serve(sched, prompts):
    """Submit every prompt at once (the whole prompt is its context), run until idle; the tickets."""
    tickets = [
        sched.submit(ServeRequest(("base", "math")[i % 2], p, max_new_tokens=N_NEW, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    sched.run_until_idle()
    return tickets


def _tokens(tickets):
    assert all(t.state == "done" for t in tickets), [t.error for t in tickets]
    return [list(t.result.token_ids) for t in tickets]


def test_budget_allocates_the_arena_whole_and_outputs_equal_the_default(folders):
    prompts = [_ids(200, i) for i in range(6)]  # 6 contexts of 199 slots live together: 1194 > 1024

    default = _scheduler(folders, "--kv-budget-mb", "4")
    assert default.engine.arena.capacity == 1024 and default.engine.arena.max_tokens is None
    ref = _tokens(_serve(default, prompts))
    assert default.engine.arena.capacity == 2048  # the run doubled the default arena

    sched = _scheduler(folders, "--kv-budget-mb", "4", "--max-prefix-tokens", "budget")
    arena = sched.engine.arena
    slots = 4 * 2**20 // PER_TOKEN
    assert sched.engine.kv_bytes_per_token == PER_TOKEN and slots == 8192
    assert arena.capacity == arena.max_tokens == slots and arena.nbytes == 4 * 2**20 == sched.arena_bytes
    got = _tokens(_serve(sched, prompts))
    assert arena.capacity == slots and arena.generation == 0 and sched.arena_bytes == 4 * 2**20
    assert got == ref and all(len(t) == N_NEW for t in got)
    assert sched.live_bytes == 0 and sched.counters["arena_waits"] == 0

    explicit = _scheduler(folders, "--max-prefix-tokens", "1500")  # N slots, with or without a budget
    assert explicit.engine.arena.capacity == explicit.engine.arena.max_tokens == 1500
    assert _tokens(_serve(explicit, prompts)) == ref and explicit.engine.arena.capacity == 1500
    zero = _scheduler(folders, "--max-prefix-tokens", "0")  # the default: it grows
    assert zero.engine.arena.capacity == 1024 and zero.engine.arena.max_tokens is None


def test_a_context_waits_for_room_and_one_over_the_arena_fails_as_at_capacity(folders):
    prompts = [_ids(201, 20 + i) for i in range(3)]  # contexts of 200 slots
    ref = _tokens(_serve(_scheduler(folders), prompts))

    sched = _scheduler(folders, "--max-prefix-tokens", "300")  # room for one such context at a time
    got = _tokens(_serve(sched, prompts))
    assert got == ref
    assert sched.counters["arena_waits"] >= 2 and sched.engine.arena.capacity == 300
    # a context longer than the whole arena: its prefill raises CapacityError, the request fails alone
    big, small = _serve(sched, [_ids(400, 30), prompts[1]])  # base, then math
    assert big.state == "error" and "CapacityError" in big.error and "max_prefix_tokens=300" in big.error
    assert _tokens([small]) == ref[1:2]  # served on
    assert sched.live_bytes == 0 and sched.engine.arena.used_tokens == 0


@pytest.mark.parametrize(
    "options, words",
    [
        (["--max-prefix-tokens", "many"], "--max-prefix-tokens 'many': use a whole number of token slots"),
        (["--max-prefix-tokens", "-3"], "--max-prefix-tokens '-3'"),
        (["--max-prefix-tokens", "1.5"], "--max-prefix-tokens '1.5'"),
        (["--max-prefix-tokens", ""], "--max-prefix-tokens ''"),
        (
            ["--max-prefix-tokens", "budget"],
            "--max-prefix-tokens budget sizes the prefix arena from --kv-budget-mb",
        ),
        (
            ["--max-prefix-tokens", "budget", "--kv-budget-mb", "0.0001"],
            "--kv-budget-mb 0.0001 holds no token of this model's KV",
        ),
    ],
)
def test_bad_values_name_the_flag(folders, options, words):
    with pytest.raises(ccft.ConfigError, match=words.replace(".", r"\.")):
        _scheduler(folders, *options)
