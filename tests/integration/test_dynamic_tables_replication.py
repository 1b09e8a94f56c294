"""Dynamic tables on a replicated PS: the full sync at attach, forwarded creates and pushes, and a
restore keep the backup's shards bit-identical (digest) to the primary's; a promoted backup serves
the same rows and treats the primary's applied pushes as duplicates."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from jaxdist.base.errors import InvalidRequestError
from jaxdist.ps_server.client import PSClient
from jaxdist.ps_server.dynamic_table import AdmissionConfig, DynamicTableConfig, EvictionConfig, RowOptimizer
from jaxdist.ps_server.server import ParameterServer
from conftest import CREDS

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pair() -> Iterator[tuple[ParameterServer, ParameterServer, PSClient, PSClient]]:
    servers = [ParameterServer(credentials=CREDS, data_port=None) for _ in range(2)]
    for s in servers:
        s.start()
    clients = [PSClient(s.address, CREDS) for s in servers]
    yield servers[0], servers[1], clients[0], clients[1]
    for c in clients:
        c.close()
    for s in servers:
        s.stop(grace=None)


def _cfg(name: str, **kw: object) -> DynamicTableConfig:
    base: dict[str, object] = dict(row_shape=(3,), seed=2, optimizer=RowOptimizer("lazy_adam", 0.1),
                                   admission=AdmissionConfig(min_count=2), eviction=EvictionConfig(capacity=20, ttl_steps=9))
    base.update(kw)
    return DynamicTableConfig(name, **base)  # type: ignore[arg-type]


def _push_some(c: PSClient, table: str, rng: np.random.Generator, n: int, tag: str, strings: bool = False) -> None:
    for i in range(n):
        ids = (rng.zipf(1.3, size=10) % 60).astype(np.int64)
        keys = [f"s{k}" for k in ids.tolist()] if strings else ids
        c.dynamic_push(table, keys, rng.standard_normal((10, 3)).astype(np.float32), update_id=f"{tag}{i}")


def _digests(ps: ParameterServer) -> dict[str, str]:
    d = ps.servicer.dynamic
    return {n: d.get(n).digest() for n in d.names()}


def test_backup_stays_identical_and_takes_over(pair) -> None:  # type: ignore[no-untyped-def]
    primary, backup, pc, bc = pair
    rng = np.random.default_rng(0)
    pc.create_dynamic_table(_cfg("a"), 0, 2)  # shard 0 of 2: its own counters must survive the copy
    keys_a = np.array([k for k in range(200) if k % 2 == 0], np.int64)
    # Only keys routed to shard 0 may be pushed to it.
    from jaxdist.ps_server.dynamic_table import hash_keys, shard_of
    mine = keys_a[shard_of(hash_keys(keys_a), 2) == 0]
    for i in range(15):
        ks = rng.choice(mine, size=8)
        pc.dynamic_push("a", ks, rng.standard_normal((8, 3)).astype(np.float32), update_id=f"a{i}")
    pc.set_backup(backup.address, 1)  # full sync, dynamic tables included
    assert _digests(backup) == _digests(primary)
    pc.create_dynamic_table(_cfg("b", key_dtype="string"), 0, 1)  # forwarded create
    for i in range(15, 40):
        ks = rng.choice(mine, size=8)
        pc.dynamic_push("a", ks, rng.standard_normal((8, 3)).astype(np.float32), update_id=f"a{i}")
    _push_some(pc, "b", rng, 25, "b", strings=True)
    assert primary.servicer.dynamic.get("a").stats()["evictions"] > 0
    assert _digests(backup) == _digests(primary) and set(_digests(primary)) == {"a", "b"}
    # The backup takes over: same rows, and the primary's applied pushes are duplicates there.
    assert bc.promote(2) == 2
    assert np.array_equal(bc.dynamic_lookup("a", mine)[0], pc.dynamic_lookup("a", mine)[0])
    assert bc.dynamic_push("a", mine[:1], np.ones((1, 3), np.float32), update_id="a39").duplicate
    assert bc.dynamic_push("b", ["s1"], np.ones((1, 3), np.float32), update_id="b24").duplicate


def test_counted_pushes_reach_the_backup_counted(pair) -> None:  # type: ignore[no-untyped-def]
    """Counted pushes (each key once, with its count) and uncounted ones are forwarded as they came: the
    backup stays identical to the primary, and both to a shard fed every batch uncounted."""
    from jaxdist.ps_server.dynamic_table import DynamicTableShard, reduce_push, validate_keys

    primary, backup, pc, bc = pair
    cfg = _cfg("c", key_dtype="string")
    pc.create_dynamic_table(cfg, 0, 1)
    pc.set_backup(backup.address, 1)
    ref = DynamicTableShard(cfg)
    rng = np.random.default_rng(5)
    for i in range(30):
        keys = [f"s{k}" for k in (rng.zipf(1.2, size=24) % 50).tolist()]
        g = rng.standard_normal((24, 3)).astype(np.float32)
        ref.apply(keys, g)
        if i % 3:
            red = reduce_push(validate_keys(keys, "string"), g)
            pc.dynamic_push("c", red.keys, red.grads, update_id=f"c{i}", counts=red.counts)
        else:
            pc.dynamic_push("c", keys, g, update_id=f"c{i}")
    st = ref.stats()
    assert st["evictions"] > 0 and st["admissions_refused"] > 0
    assert _digests(primary) == _digests(backup) == {"c": ref.digest()}
    assert bc.promote(2) == 2  # a counted push the primary applied is a duplicate on the promoted backup
    red = reduce_push(["s1", "s1"], np.ones((2, 3), np.float32))
    assert bc.dynamic_push("c", red.keys, red.grads, update_id="c29", counts=red.counts).duplicate


def test_restore_on_a_replicated_primary_reaches_the_backup(pair, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from jaxdist.proto import ps_pb2

    primary, backup, pc, _ = pair
    rng = np.random.default_rng(1)
    pc.create_dynamic_table(_cfg("t", eviction=EvictionConfig()), 0, 1)
    _push_some(pc, "t", rng, 20, "t")
    saved = pc.save(str(tmp_path), "ps-0.npz")
    saved_digest = _digests(primary)["t"]
    pc.set_backup(backup.address, 1)
    _push_some(pc, "t", rng, 10, "u")
    assert _digests(backup) == _digests(primary) != {"t": saved_digest}
    req = ps_pb2.RestoreRequest(directory=str(tmp_path))
    e = req.dynamic.add(config_json=__import__("json").dumps(_cfg("t", eviction=EvictionConfig()).to_json()),
                        shard=0, num_shards=1)
    e.files.add(file=saved.file_name, sha256=saved.sha256)
    pc.restore(req)
    assert _digests(primary) == {"t": saved_digest} == _digests(backup)


def test_a_shard_over_the_message_limit_is_synced_and_forwarded_in_chunks() -> None:
    """The full sync and a restore's forward send a dynamic shard's arrays as payload frames after the
    header (as a variable's value), not inline in one protobuf message: a backup that takes messages
    of 5 MB at most receives an 8 MB shard whole, twice, and stays attached and identical."""
    from jaxdist.ps_server.dynamic_tables import install_message

    limit = 5 << 20  # > codec.CHUNK_BYTES (4 MB), the payload frame size
    primary = ParameterServer(credentials=CREDS, data_port=None)
    backup = ParameterServer(credentials=CREDS, data_port=None, max_message_bytes=limit)
    for s in (primary, backup):
        s.start()
    pc = PSClient(primary.address, CREDS)
    try:
        cfg = DynamicTableConfig("big", (64,), seed=1, optimizer=RowOptimizer("lazy_adam", 0.1))
        pc.create_dynamic_table(cfg, 0, 1)
        rng = np.random.default_rng(0)
        for i in range(4):
            keys = np.arange(i * 2500, (i + 1) * 2500, dtype=np.int64)
            pc.dynamic_push("big", keys, rng.standard_normal((2500, 64)).astype(np.float32), update_id=f"p{i}")
        shard = primary.servicer.dynamic.get("big")
        assert install_message(shard).ByteSize() > limit + (2 << 20)  # inline, it could not pass
        pc.set_backup(backup.address, 1)  # the full sync
        assert _digests(backup) == _digests(primary) and len(backup.servicer.dynamic.get("big")) == 10000
        pc.dynamic_push("big", np.arange(5, dtype=np.int64), np.ones((5, 64), np.float32), update_id="after")
        primary.servicer.dynamic.forward_installs(["big"])  # what a restore on the primary sends
        repl = primary.servicer.replication
        assert repl.backup == backup.address and repl.degraded_events == 0  # not detached by a refusal
        assert _digests(backup) == _digests(primary)
        # A payload short or long by one array is refused before anything changes.
        payload: list[np.ndarray] = []
        msg = install_message(shard, payload)
        before = _digests(backup)
        for bad, match in ((payload[:-1], "payload is short"), (payload + [payload[0]], "more payload arrays")):
            with pytest.raises(InvalidRequestError, match=match):
                backup.servicer.dynamic.accept_installs([msg], replace_all=True, payload=bad)
        assert _digests(backup) == before
    finally:
        pc.close()
        for s in (primary, backup):
            s.stop(grace=None)
