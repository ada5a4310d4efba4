"""The Redis tier over TLS (``rediss://``) against Debian's redis-server built with TLS.

A throwaway CA and server certificate are made with the openssl CLI for each
run; the server speaks TLS only (``--port 0 --tls-port``).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.redis_server import RedisServer, make_tls_files
from helpers.store import row, small_namespace

from canonical_ops.units import RedisStore, RedisStoreError

NS = small_namespace(32)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    tls = make_tls_files(str(tmp_path_factory.mktemp("tls")))
    srv = RedisServer(str(tmp_path_factory.mktemp("redis-tls")), tls=tls, password="tls-pw")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_tls_round_trip(tls_server) -> None:
    url = tls_server.url_for(None, "tls-pw")
    assert url.startswith("rediss://")
    with RedisStore(url, NS, ssl_ca_certs=tls_server.tls.ca_cert, max_value_bytes=4096) as store:
        payloads = [row(NS, i) for i in range(4)]
        assert store.stores([(i, 0, p, i) for i, p in enumerate(payloads)]).ok
        outs = [np.zeros(NS.total_bytes, np.uint8) for _ in payloads]
        assert store.loads([(i, 0, 32, o) for i, o in enumerate(outs)]).ok
        for out, payload in zip(outs, payloads):
            assert np.array_equal(out, payload)


def test_tls_with_an_unknown_ca_is_refused_at_start_up(tls_server) -> None:
    # The system CA bundle does not know the throwaway CA: verification fails.
    with pytest.raises(RedisStoreError, match="certificate verify failed"):
        RedisStore(tls_server.url_for(None, "tls-pw"), NS, connect_timeout_s=2)
    # A plain-text client talking to the TLS port gets no Redis answer either.
    plain = tls_server.url_for(None, "tls-pw").replace("rediss://", "redis://")
    with pytest.raises(RedisStoreError, match="url"):
        RedisStore(plain, NS, connect_timeout_s=1, socket_timeout_s=1, retries=0)
