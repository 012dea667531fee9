"""The ranks' rendezvous answers only holders of the cluster's key, and torch.distributed runs on
it; a rank binds gloo where it is reached, not where its host name happens to resolve."""

from __future__ import annotations

import secrets
import threading
from datetime import timedelta
from multiprocessing import AuthenticationError

import pytest
import torch
import torch.distributed as dist

from shoal.engine.parallel.addresses import address_towards, interface_of
from shoal.engine.parallel.rendezvous import AuthStore, StoreServer
from tests.server_helpers import free_port


@pytest.fixture
def server():
    key = secrets.token_bytes(32)
    srv = StoreServer("127.0.0.1", free_port(), key)
    yield srv, key
    srv.close()


def test_a_wrong_key_or_a_plain_tcpstore_client_learns_nothing(server):
    srv, key = server
    host, port = srv.address
    store = AuthStore(host, port, key, timedelta(seconds=5))
    store.set("secret", b"gloo address")
    with pytest.raises(AuthenticationError):
        AuthStore(host, port, secrets.token_bytes(32), timedelta(seconds=5))
    with pytest.raises((RuntimeError, OSError)):  # torch's own client speaks no handshake the server accepts
        dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2)).get("secret")
    assert store.get("secret") == b"gloo address"  # and the server still serves its ranks


def test_the_store_keeps_torchs_contract(server):
    srv, key = server
    a = AuthStore(*srv.address, key, timedelta(seconds=5))
    b = AuthStore(*srv.address, key, timedelta(seconds=5))
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    assert not a.check(["k"])
    threading.Timer(0.2, lambda: b.set("k", "v")).start()
    a.wait(["k"])  # blocks until another client sets it
    assert a.get("k") == b"v" and a.check(["k"])
    assert a.compare_set("k", b"v", b"w") == b"w" and a.compare_set("k", b"v", b"x") == b"w"
    assert a.delete_key("k") and not a.delete_key("k")
    b.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(RuntimeError, match="not set within"):
        b.get("never")


def test_torch_distributed_runs_a_gloo_group_on_it(server):
    srv, key = server
    results = {}

    def rank(r: int) -> None:
        # Two groups of one in one process prove the store's part (addresses swapped, connected).
        # The Python store must outlive the group: torch holds only its C++ side.
        keep = AuthStore(*srv.address, key, timedelta(seconds=20))
        store = dist.PrefixStore(f"r{r}", keep)
        pg = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=20))
        t = torch.ones(3) * (r + 1)
        pg.allreduce([t]).wait()
        results[r] = t.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: [1.0, 1.0, 1.0], 1: [2.0, 2.0, 2.0]}


def test_the_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert address_towards("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ValueError, match=r"192\.0\.2\.77"):
        interface_of("192.0.2.77")  # TEST-NET-1: on no interface here
