"""The suite is hermetic: hub clients are offline in this process and sockets reach only loopback."""

from __future__ import annotations

import socket

import pytest


def test_hub_clients_are_offline_in_process():
    """lm-eval, datasets and transformers run in-process in tests/evals: their own offline switches are on."""
    import huggingface_hub.constants
    from huggingface_hub import is_offline_mode

    assert huggingface_hub.constants.HF_HUB_OFFLINE is True
    assert is_offline_mode() is True
    datasets = pytest.importorskip("datasets")
    assert datasets.config.HF_HUB_OFFLINE is True and datasets.config.HF_DATASETS_OFFLINE is True


@pytest.mark.parametrize("address", [("192.0.2.1", 80), ("2001:db8::1", 443, 0, 0), ("1.1.1.1", 53)])
def test_non_loopback_addresses_are_refused_before_any_packet(loopback_only, address):
    # the check itself (never a real connect to these: a broken guard would send traffic)
    with pytest.raises(OSError, match="beyond loopback"):
        loopback_only(address)
    assert socket.socket.connect.__name__ == "guarded_connect"


def test_loopback_connections_still_work(loopback_only):
    for address in [("127.0.0.1", 1), ("localhost", 1), ("::1", 1, 0, 0), "/tmp/x.sock"]:
        loopback_only(address)  # no error
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=5):
            conn, _ = server.accept()
            conn.close()
