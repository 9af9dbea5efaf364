"""Scale-out on Ray Serve (``ccft serve --replicas N``, ``ccft.serving.ray_serve``).

Fast (no Ray instance): the router's placement over replica ids (affinity, overload fallback, a dead
home, requests without a session; the ``prefix`` policy picks the replica holding a prompt's blocks, from
the prompt the ingress reads off the body), the body's session and prompt hints, and config errors
before any deploy.

Slow (a local Ray instance, ``ray.init(num_cpus=2, include_dashboard=False)`` on 127.0.0.1, about a
minute to start here): the app ``ccft serve --replicas 2`` builds, over a tiny Llama and a LoRA
decoder saved to folders, on Ray Serve's HTTP proxy at 127.0.0.1. Checked: greedy outputs (text and
token ids; completions, chat, streaming) equal an offline single engine's; a session's requests land
on one replica (the ``x-ccft-replica`` header) and a new session goes to the less-loaded replica;
killing the replica that runs a session's requests mid-decode loses none: the non-streamed ones are
retried on the other replica with the reference outputs (``x-ccft-attempts: 2``), the stream under
way ends with a ``replica_failed`` error event, and ``/ray/stats`` counts both.
"""

import json
import os
import socket
import threading
import time

import pytest

pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'ccft[serve,ray]'")
pytest.importorskip("fastapi", reason="the serve extra is not installed")

import httpx  # noqa: E402

import ccft  # noqa: E402
from ccft.core.errors import ConfigError  # noqa: E402
from ccft.core.tokens import tokenize_prompt  # noqa: E402
from ccft.serving.ray_serve import (  # noqa: E402
    ATTEMPTS_HEADER,
    REPLICA_HEADER,
    SESSION_HEADER,
    ForwardedRequest,
    SessionRequestRouter,
    build_app,
    prompt_of,
    replica_actor,
    request_hints,
    session_of,
)
from conftest import make_lora, make_tiny_folder, ragged_prompts  # noqa: E402

WAIT = 300.0  # seconds: bound on every request and wait (against hangs only; nothing asserts on time)


# ------------------------------------------------------------------------------------ fast: no Ray instance
def _router(**options) -> SessionRequestRouter:
    r = SessionRequestRouter.__new__(SessionRequestRouter)  # the policy part only (no Ray router state)
    r.initialize_state(**options)
    return r


def test_router_affinity_and_fallback():
    r = _router(policy="session", max_load_ratio=2.0, min_load_gap=4)
    ids = ["a", "b"]
    assert r.place("s1", ids, [0, 0]) == 0  # new session: least loaded, ties lowest index
    assert r.place("s2", ids, [1, 0]) == 1  # new session: least loaded
    assert r.place("s1", ids, [3, 0]) == 0  # home, not overloaded (gap 3 < 4)
    assert r.place("s1", ids, [4, 0]) == 1  # gap 4 and 4 > 2*0: falls back, re-pinned
    assert r.homes["s1"] == "b"
    assert r.place("s1", ids, [0, 1]) == 1  # stays on its new home
    assert r.policy.stats() == {"new": 2, "affinity": 2, "fallback": 1, "sessions": 2}


def test_router_follows_replica_ids_not_positions():
    r = _router()
    assert r.place("s", ["a", "b"], [1, 0]) == 1  # home "b"
    assert r.place("s", ["b", "c"], [0, 0]) == 0  # "a" left: "b" is index 0 now, still home
    assert r.place("s", ["c", "d"], [5, 0]) == 1  # home gone: placed as new (least loaded)
    assert r.homes["s"] == "d"
    assert r.policy.stats()["new"] == 2


def test_router_without_session_is_least_loaded():
    r = _router()
    assert [r.place(None, ["a", "b", "c"], loads) for loads in ([0, 0, 0], [2, 1, 1], [0, 3, 0])] == [0, 1, 0]
    assert r.homes == {} and r.policy.stats()["sessions"] == 0
    rr = _router(policy="round-robin")
    assert [rr.place("s", ["a", "b"], [0, 0]) for _ in range(3)] == [0, 1, 0]


def test_prefix_policy_prefers_the_replica_holding_the_blocks():
    r = _router(policy="prefix", block_tokens=4)
    ctx = list(range(100, 116))  # 4 blocks
    assert r.place("a", ["r1", "r2"], [1, 0], ctx) == 1  # nothing placed: least loaded
    # a new session over the same context goes to r2, which holds its blocks (session would pick r1)
    assert r.place("b", ["r1", "r2"], [0, 1], ctx + [7, 8, 9, 10]) == 1
    assert r.place(None, ["r1", "r2"], [0, 2], ctx) == 1  # no session: by its blocks too
    assert r.homes == {"a": "r2", "b": "r2"}
    assert r.place("b", ["r1", "r2"], [0, 4], ctx) == 0  # r2 overloaded: moved to r1, which records it
    assert r.homes["b"] == "r1" and r.policy.matched_blocks(r.policy.keys(ctx), "r1") == 4
    # r2 gone, r3 new: r1 still holds the context, r3 nothing
    assert r.place(None, ["r1", "r3"], [1, 0], ctx) == 0
    assert set(r.policy.held) == {"r1"}
    # a text prompt (no ids in the body) is placed by its text's blocks
    text = "You are a careful planner. " * 4
    assert r.place(None, ["r1", "r3"], [0, 1], text) == 0  # no text placed yet: least loaded
    assert r.place(None, ["r1", "r3"], [2, 0], text + "Plan the trip.") == 0
    assert r.policy.stats()["prefix"] == 4


def test_choose_replicas_reads_the_prompt_of_the_forwarded_request():
    import asyncio
    from collections import namedtuple
    from types import SimpleNamespace

    Rid = namedtuple("Rid", "unique_id")
    replicas = [SimpleNamespace(replica_id=Rid(u)) for u in ("b", "a")]  # ordered by id: a, b
    r = _router(policy="prefix", block_tokens=4)
    loads = {Rid("a"): 1, Rid("b"): 0}
    r.load = lambda replica: loads[replica.replica_id]
    ctx = list(range(16))

    def choose(body: dict):
        raw = json.dumps(body).encode()
        sid, stream, prompt = request_hints(raw)
        fwd = ForwardedRequest(
            "POST", "/v1/completions", body=raw, session_id=sid, stream=stream, prompt=prompt
        )
        pending = SimpleNamespace(args=[fwd], routing_context=SimpleNamespace(should_backoff=False))
        ((chosen,),) = asyncio.run(r.choose_replicas(replicas, pending))
        return chosen.replica_id.unique_id

    assert choose({"model": "m", "prompt": ctx, "session_id": "s"}) == "b"  # least loaded
    loads.update({Rid("a"): 0, Rid("b"): 2})
    assert choose({"model": "m", "prompt": ctx + [1, 2, 3, 4]}) == "b"  # where the context is
    assert choose({"model": "m", "prompt": [5] * 16}) == "a"  # another prompt: least loaded


def test_prompt_hint_of_body():
    assert prompt_of({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_of({"prompt": [[1, 2, 3]]}) == [1, 2, 3]  # a batch of one
    assert prompt_of({"prompt": "Hello"}) == prompt_of({"prompt": ["Hello"]}) == "Hello"
    for junk in ({"prompt": []}, {"prompt": [True]}, {"prompt": 3}, {"prompt": ""}, {"messages": []}, {}):
        assert prompt_of(junk) is None
    turn1 = [{"role": "system", "content": "Plan."}, {"role": "user", "content": "Go"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Done"}, {"content": "Next", "role": "user"}]
    t1, t2 = prompt_of({"messages": turn1}), prompt_of({"messages": turn2})
    assert (
        t2.startswith(t1) and t1 == '{"content": "Plan.", "role": "system"}{"content": "Go", "role": "user"}'
    )
    assert prompt_of({"messages": turn1, "tools": [{"type": "function"}]}).startswith(
        '[{"type": "function"}]'
    )
    assert request_hints(b'{"session_id": "s", "stream": true, "prompt": [4, 5]}') == ("s", True, [4, 5])
    assert request_hints(b'{"prompt": [4, 5]}', with_prompt=False) == (None, False, None)
    assert request_hints(b"not json") == (None, False, None)


def test_session_hint_of_body():
    assert session_of(b'{"session_id": "s1", "stream": true}') == ("s1", True)
    assert session_of(b'{"session_id": 7}') == ("7", False)
    assert session_of(b'{"prompt": "x"}') == (None, False)
    assert session_of(b"not json") == (None, False)
    assert session_of(b"[1, 2]") == (None, False)


def test_config_errors_before_deploy():
    with pytest.raises(ConfigError, match="replicas"):
        build_app(lambda: None, replicas=0)
    with pytest.raises(ConfigError, match="choices: least-loaded, prefix, round-robin, session"):
        build_app(lambda: None, policy="sticky")
    with pytest.raises(ConfigError, match="min_load_gap"):
        build_app(lambda: None, policy_options={"min_load_gap": 0})
    with pytest.raises(ConfigError, match="retries"):
        build_app(lambda: None, retries=-1)
    with pytest.raises(ConfigError, match="max_keys_per_worker: must be an int >= 1"):
        build_app(lambda: None, policy="prefix", policy_options={"max_keys_per_worker": 0})


def test_cli_errors_before_ray_starts():
    from ccft.cli.main import build_parser
    from ccft.cli.serve import ray_app

    parse = build_parser().parse_args
    with pytest.raises(ConfigError, match="--decoder 'math': use NAME=PATH"):
        ray_app(parse(["serve", "--replicas", "2", "--decoder", "math"]))
    with pytest.raises(ConfigError, match="--replicas -1"):
        ray_app(parse(["serve", "--replicas", "-1"]))
    with pytest.raises(ConfigError, match="min_load_gap: must be >= 1"):
        ray_app(parse(["serve", "--replicas", "2", "--min-load-gap", "0"]))
    with pytest.raises(ConfigError, match="--allow-reload is not available with --replicas"):
        ray_app(parse(["serve", "--replicas", "2", "--allow-reload"]))
    # each replica sizes its arena by the rule of build_scheduler; a bad value fails here, before Ray starts
    with pytest.raises(ConfigError, match="--max-prefix-tokens 'many'"):
        ray_app(parse(["serve", "--replicas", "2", "--max-prefix-tokens", "many"]))
    with pytest.raises(ConfigError, match="--max-prefix-tokens budget sizes the prefix arena"):
        ray_app(parse(["serve", "--replicas", "2", "--max-prefix-tokens", "budget"]))
    with pytest.raises(ConfigError, match="--prefix-pool 'redis:/x': use redis://HOST:PORT"):
        ray_app(parse(["serve", "--replicas", "2", "--prefix-pool", "redis:/x"]))
    with pytest.raises(
        ConfigError, match="--block-tokens 0 turns the prefix store off; give --block-tokens N"
    ):
        ray_app(parse(["serve", "--replicas", "2", "--router", "prefix", "--block-tokens", "0"]))
    with pytest.raises(ConfigError, match="max_keys_per_worker: must be an int >= 1 .*--router-keys"):
        ray_app(parse(["serve", "--replicas", "2", "--router", "prefix", "--router-keys", "0"]))
    with pytest.raises(ConfigError, match="--malloc 'jemalloc': use one of trim, mmap-64k, glibc"):
        ray_app(parse(["serve", "--replicas", "2", "--malloc", "jemalloc"]))


@pytest.mark.parametrize(
    "flags, policy",
    [([], "trim"), (["--malloc", "mmap-64k"], "mmap-64k"), (["--no-tune-malloc"], "glibc")],
)
def test_each_replica_applies_the_malloc_policy_before_its_model_loads(monkeypatch, flags, policy):
    """An allocator policy is per process: the factory ``ray_app`` deploys applies ``--malloc`` in the
    replica's process, then builds its scheduler (the driver's policy would not reach the replicas)."""
    import ccft.cli.serve as cli_serve
    import ccft.serving.malloc as malloc
    import ccft.serving.ray_serve as ray_serve
    from ccft.cli.main import build_parser

    calls, deployed = [], {}
    monkeypatch.setattr(malloc, "apply_malloc_policy", lambda p: calls.append(("malloc", p)))
    monkeypatch.setattr(cli_serve, "build_scheduler", lambda a: calls.append(("build", a.replicas)) or "s")
    monkeypatch.setattr(ray_serve, "build_app", lambda factory, **kw: deployed.update(f=factory) or "app")
    args = build_parser().parse_args(["serve", "--replicas", "2", *flags])
    assert cli_serve.ray_app(args) == "app"
    assert calls == []  # nothing is applied in the driver
    assert deployed["f"]() == "s"  # what each replica runs at its start
    assert calls == [("malloc", policy), ("build", 2)]


def test_cli_router_options():
    from ccft.cli.main import build_parser
    from ccft.cli.serve import router_options

    parse = build_parser().parse_args
    assert router_options(parse(["serve", "--replicas", "2"])) == {"max_load_ratio": 2.0, "min_load_gap": 4}
    assert router_options(parse(["serve", "--replicas", "2", "--router", "round-robin"])) == {}
    argv = ["serve", "--replicas", "2", "--router", "prefix", "--block-tokens", "8", "--router-keys", "100"]
    assert router_options(parse(argv)) == {
        "max_load_ratio": 2.0,
        "min_load_gap": 4,
        "block_tokens": 8,
        "max_keys_per_worker": 100,
    }


# --------------------------------------------------------------------------------- slow: a local Ray instance
@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """(tiny base folder, {name: decoder folder}, offline single engine over the same folders)."""
    root = tmp_path_factory.mktemp("ray")
    folder = make_tiny_folder(root / "base", tokenizer, seed=13, scale=8.0)
    base = ccft.load_base(str(folder))
    ccft.save_decoder(make_lora(base, "math", 31, 4), root / "math")
    decoders = {"math": str(root / "math")}
    engine = ccft.SharedPrefillEngine(ccft.load_base(str(folder)), decoders=decoders)
    return folder, decoders, engine


def _offline(engine, prompts, decoder, max_tokens, ignore_eos=False):
    with engine.prefill([list(p) for p in prompts]) as h:
        return engine.generate(h, decoder=decoder, max_new_tokens=max_tokens, ignore_eos=ignore_eos)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(world):
    """The app of ``ccft serve --replicas 2 --threads 1 --min-load-gap 8`` on a local Ray, at 127.0.0.1."""
    import ray
    from ray import serve

    from ccft.cli.main import build_parser
    from ccft.cli.serve import ray_app

    folder, decoders, _ = world
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # min-load-gap 8: the fault test loads one replica with 3 requests and must keep its session there
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(folder),
            "--threads",
            "1",
            "--replicas",
            "2",
            "--min-load-gap",
            "8",
            *[f"--decoder={k}={v}" for k, v in decoders.items()],
        ]
    )
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_app(args), name="ccft", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=WAIT) as client:
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(client, **body):
    r = client.post("/v1/completions", json={"return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r


@pytest.mark.slow
def test_outputs_equal_single_engine(cluster, world, tokenizer, gsm8k_rows):
    _, _, engine = world
    prompts = ragged_prompts(gsm8k_rows, tokenizer, 4, 20, 7)
    jobs = [(f"eq{i}", "math" if i % 2 else "base", p) for i, p in enumerate(prompts)]
    results: dict = {}

    def send(sid, model, ids):
        results[sid] = _complete(cluster, model=model, prompt=ids, max_tokens=8, session_id=sid)

    threads = [threading.Thread(target=send, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    for sid, model, ids in jobs:
        (ref,) = _offline(engine, [ids], model, 8)
        (choice,) = results[sid].json()["choices"]
        assert choice["token_ids"] == ref.token_ids and choice["text"] == ref.text
        assert results[sid].headers[REPLICA_HEADER].startswith("SERVE_REPLICA::ccft#Engine#")
    # chat, and a stream whose deltas concatenate to the same text
    messages = [{"role": "user", "content": gsm8k_rows[9]["prompt"][:80]}]
    (ref,) = _offline(engine, [tokenize_prompt(tokenizer, messages, chat_template=True)], "math", 6)
    r = cluster.post("/v1/chat/completions", json={"model": "math", "messages": messages, "max_tokens": 6})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text
    (ref,) = _offline(engine, [prompts[0]], "math", 8)
    r = cluster.post(
        "/v1/completions", json={"model": "math", "prompt": prompts[0], "max_tokens": 8, "stream": True}
    )
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and "data: [DONE]" in r.text
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == ref.text
    # the routes and errors are the single-engine app's
    assert {m["id"] for m in cluster.get("/v1/models").json()["data"]} == {"base", "math"}
    bad = cluster.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


@pytest.mark.slow
def test_session_requests_stay_on_one_replica(cluster, tokenizer, gsm8k_rows):
    ctx = ragged_prompts(gsm8k_rows, tokenizer, 2, 40, 0)
    with cluster.stream(
        "POST",
        "/v1/completions",
        json={
            "model": "math",
            "prompt": ctx[0],
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
            "session_id": "A",
        },
    ) as stream:
        chunks = stream.iter_bytes()
        next(chunks)  # A's first turn is decoding on its replica
        home_a = stream.headers[REPLICA_HEADER]
        # B arrives while A's replica has one request and the other none: the less-loaded one
        home_b = _complete(cluster, model="base", prompt=ctx[1], max_tokens=4, session_id="B").headers[
            REPLICA_HEADER
        ]
        assert home_b != home_a
        seen = {"A": set(), "B": set()}
        for turn in range(3):
            for sid, p in (("A", ctx[0]), ("B", ctx[1])):
                ids = p + p[: 5 * (turn + 1)]  # the session's growing context
                seen[sid].add(
                    _complete(cluster, model="math", prompt=ids, max_tokens=3, session_id=sid).headers[
                        REPLICA_HEADER
                    ]
                )
        for _ in chunks:
            pass
    assert seen == {"A": {home_a}, "B": {home_b}}
    # a GET names its session in a header
    assert cluster.get("/health", headers={SESSION_HEADER: "B"}).headers[REPLICA_HEADER] == home_b


@pytest.mark.slow
def test_killed_replica_loses_no_accepted_request(cluster, world, tokenizer, gsm8k_rows):
    """Runs last: it kills a replica (Ray Serve starts a replacement)."""
    import ray

    _, _, engine = world
    prompts = ragged_prompts(gsm8k_rows, tokenizer, 3, 30, 4)
    refs = _offline(engine, prompts[1:], "math", 400, ignore_eos=True)
    answers: dict = {}

    def send(i):
        answers[i] = cluster.post(
            "/v1/completions",
            json={
                "model": "math",
                "prompt": prompts[i],
                "max_tokens": 400,
                "ignore_eos": True,
                "return_token_ids": True,
                "session_id": "K",
            },
        )

    with cluster.stream(
        "POST",
        "/v1/completions",
        json={
            "model": "math",
            "prompt": prompts[0],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
            "session_id": "K",
        },
    ) as stream:
        chunks = stream.iter_bytes()
        first = next(chunks)
        victim = stream.headers[REPLICA_HEADER]
        threads = [threading.Thread(target=send, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT  # against hangs only
        while True:  # until the victim holds the stream and both requests
            h = cluster.get("/health", headers={SESSION_HEADER: "K"})
            assert h.headers[REPLICA_HEADER] == victim
            if h.json()["active_requests"] + h.json()["queue_depth"] >= 3:
                break
            assert time.monotonic() < deadline, "the requests never reached the replica"
            time.sleep(0.05)
        ray.kill(replica_actor(victim), no_restart=True)
        rest = first + b"".join(chunks)
        for t in threads:
            t.join(WAIT)
    events = [json.loads(line[6:]) for line in rest.decode().splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "replica_failed" and "died" in events[-1]["error"]["message"]
    for i, ref in zip((1, 2), refs):
        r = answers[i]
        assert r.status_code == 200, r.text
        assert r.headers[ATTEMPTS_HEADER] == "2" and r.headers[REPLICA_HEADER] != victim
        assert r.json()["choices"][0]["token_ids"] == ref.token_ids
    stats = cluster.get("/ray/stats").json()
    assert stats["retried"] == 2 and stats["failed"] == 1
