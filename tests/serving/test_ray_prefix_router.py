"""``ccft serve --replicas 2 --router prefix`` on a local Ray instance (slow; the policy itself and the Ray
router's use of it are tested without Ray in test_prefix_router.py and test_ray_serve.py).

The app over a tiny Llama, on Ray Serve's HTTP proxy at 127.0.0.1: while session A's first turn decodes
on its replica (load 1 there, 0 on the other), a new session B over the same context, a request without a
session over it, and a text prompt sent again with a longer tail all go to the replica that holds their
blocks, where the ``session`` router would send a new session to the idle replica (test_ray_serve.py).
"""

import os
import socket

import pytest

pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'ccft[serve,ray]'")
pytest.importorskip("fastapi", reason="the serve extra is not installed")

import httpx  # noqa: E402

from ccft.serving.ray_serve import REPLICA_HEADER  # noqa: E402
from conftest import make_tiny_folder, ragged_prompts  # noqa: E402

WAIT = 300.0  # seconds: bound on every request (against hangs only; nothing asserts on time)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefix_cluster(tmp_path_factory, tokenizer):
    """The app of ``ccft serve --replicas 2 --router prefix --block-tokens 4 --threads 1`` on a local Ray."""
    import ray
    from ray import serve

    from ccft.cli.main import build_parser
    from ccft.cli.serve import ray_app

    folder = make_tiny_folder(tmp_path_factory.mktemp("ray_prefix") / "base", tokenizer, seed=13, scale=8.0)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    argv = ["serve", "--model", str(folder), "--threads", "1", "--replicas", "2", "--router", "prefix"]
    args = build_parser().parse_args([*argv, "--block-tokens", "4"])
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


def _replica(client, **body) -> str:
    r = client.post("/v1/completions", json={"model": "base", "max_tokens": 3, **body})
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER]


@pytest.mark.slow
def test_requests_follow_their_blocks(prefix_cluster, tokenizer, gsm8k_rows):
    (ctx,) = ragged_prompts(gsm8k_rows, tokenizer, 1, 40, 0)
    body = {"model": "base", "prompt": ctx, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with prefix_cluster.stream("POST", "/v1/completions", json={**body, "session_id": "A"}) as stream:
        chunks = stream.iter_bytes()
        next(chunks)  # A's first turn is decoding on its replica
        home = stream.headers[REPLICA_HEADER]
        # the session router would send B to the idle replica; its blocks are on A's
        assert _replica(prefix_cluster, prompt=ctx + ctx[:5], session_id="B") == home
        assert _replica(prefix_cluster, prompt=ctx[:32]) == home  # no session: by its blocks too
        for _ in chunks:
            pass
    text = "You are a careful planner. Think step by step and write the plan. " * 3
    first = _replica(prefix_cluster, prompt=text)
    assert _replica(prefix_cluster, prompt=text + "Now the second step.") == first
