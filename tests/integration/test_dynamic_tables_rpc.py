"""Dynamic embedding tables served by a PS over real gRPC: create / lookup / push against a
:class:`DynamicTableShard` used directly, exactly-once pushes (dedupe table, run fence), status
counters, and hostile input (typed errors with the right gRPC status, nothing changed)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from jaxdist.errors import (
    DTypeMismatchError,
    InvalidRequestError,
    PayloadTooLargeError,
    ShapeMismatchError,
    StaleRunError,
    UpdateMismatchError,
    VariableExistsError,
    VariableNotFoundError,
)
from jaxdist.proto import codec, ps_pb2
from jaxdist.ps_server.client import PSClient
from jaxdist.ps_server.dynamic_table import (
    AdmissionConfig,
    DynamicTableConfig,
    DynamicTableShard,
    EvictionConfig,
    RowOptimizer,
    reduce_push,
    validate_keys,
)
from jaxdist.ps_server.server import ParameterServer
from conftest import CREDS

pytestmark = pytest.mark.timeout(120)


def _cfg(name: str = "t", **kw: object) -> DynamicTableConfig:
    base: dict[str, object] = dict(
        row_shape=(4,), seed=7, optimizer=RowOptimizer("lazy_adam", 0.05),
        admission=AdmissionConfig(min_count=2), eviction=EvictionConfig(capacity=40, policy="lru"),
    )
    base.update(kw)
    return DynamicTableConfig(name, **base)  # type: ignore[arg-type]


@pytest.fixture
def client(ps_server: ParameterServer) -> PSClient:
    c = PSClient(ps_server.address, CREDS)
    yield c
    c.close()


def _table_counters(c: PSClient, name: str) -> dict[str, float]:
    prefix = f"dynamic/{name}/"
    return {k[len(prefix):]: v for k, v in c.status().counters.items() if k.startswith(prefix)}


def test_lookup_and_push_match_the_shard_used_directly(ps_server: ParameterServer, client: PSClient) -> None:
    cfg = _cfg()
    assert client.create_dynamic_table(cfg, 0, 1)
    assert not client.create_dynamic_table(cfg, 0, 1)  # idempotent: kept as it is
    ref = DynamicTableShard(cfg)
    rng = np.random.default_rng(0)
    for step in range(30):
        keys = rng.integers(0, 60, size=16).astype(np.int64)
        got, adm = client.dynamic_lookup("t", keys)
        want, want_adm = ref.lookup(keys)
        assert np.array_equal(got, want) and np.array_equal(adm, want_adm)
        grads = rng.standard_normal((16, 4)).astype(np.float32)
        resp = client.dynamic_push("t", keys, grads, update_id=f"u{step}")
        counts = ref.apply(keys, grads)
        assert not resp.duplicate
        assert (resp.applied, resp.refused, resp.inserted, resp.evicted) == (
            counts["applied"], counts["refused"], counts["inserted"], counts["evicted"])
    all_keys = np.arange(60, dtype=np.int64)
    assert np.array_equal(client.dynamic_lookup("t", all_keys)[0], ref.lookup(all_keys)[0])
    st = ref.stats()
    assert _table_counters(client, "t") == {k: float(st[k]) for k in
                                            ("rows", "bytes", "inserts", "admissions_refused", "evictions", "pushes",
                                             "pending_keys")}
    assert st["evictions"] > 0 and st["admissions_refused"] > 0  # the run exercised both
    # /metrics: the same figures, labelled by table.
    from jaxdist.ps_server.monitoring import PSCollector

    samples = {(m.name, sm.labels.get("table")): sm.value for m in PSCollector(ps_server.servicer).collect()
               for sm in m.samples}
    assert samples[("jaxdist_ps_dynamic_rows", "t")] == st["rows"]
    assert samples[("jaxdist_ps_dynamic_bytes", "t")] == st["bytes"]
    assert samples[("jaxdist_ps_dynamic_evictions", "t")] == st["evictions"]
    assert samples[("jaxdist_ps_dynamic_admissions_refused", "t")] == st["admissions_refused"]
    assert samples[("jaxdist_ps_dynamic_inserts", "t")] == st["inserts"]
    # jaxdist status: a table of the dynamic tables under the task table.
    from jaxdist.tools.cluster_status import StatusProbe, format_table

    with StatusProbe({"ps": [ps_server.address]}, CREDS) as probe:
        text = format_table(probe.refresh())
    line = next(ln for ln in text.splitlines() if ln.startswith("t ")).split()
    assert line[:3] == ["t", "ps:0", str(st["rows"])] and line[-3:] == [
        str(st["inserts"]), str(st["admissions_refused"]), str(st["evictions"])], text


def test_string_keys(client: PSClient) -> None:
    cfg = _cfg("s", key_dtype="string", admission=AdmissionConfig())
    client.create_dynamic_table(cfg, 0, 1)
    ref = DynamicTableShard(cfg)
    keys = ["user:a", "user:b", "user:a", "item:é"]
    g = np.ones((4, 4), np.float32)
    client.dynamic_push("s", keys, g, update_id="s1")
    ref.apply(keys, g)
    assert np.array_equal(client.dynamic_lookup("s", keys)[0], ref.lookup(keys)[0])


def test_push_is_applied_once_per_update_id(client: PSClient) -> None:
    cfg = _cfg(admission=AdmissionConfig())
    client.create_dynamic_table(cfg, 0, 1)
    client.create_dynamic_table(_cfg("other", admission=AdmissionConfig()), 0, 1)
    keys = np.array([1, 2, 3], np.int64)
    g = np.ones((3, 4), np.float32)
    assert not client.dynamic_push("t", keys, g, update_id="once").duplicate
    before = client.dynamic_lookup("t", keys)[0]
    assert client.dynamic_push("t", keys, 5 * g, update_id="once").duplicate
    assert np.array_equal(client.dynamic_lookup("t", keys)[0], before)
    assert _table_counters(client, "t")["pushes"] == 1.0
    # One identity given to a push of another table: refused, not dropped as a duplicate.
    with pytest.raises(UpdateMismatchError) as e:
        client.dynamic_push("other", keys, g, update_id="once")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert _table_counters(client, "other")["pushes"] == 0.0


def test_run_fence_refuses_pushes_of_another_run(client: PSClient) -> None:
    client.create_dynamic_table(_cfg(admission=AdmissionConfig()), 0, 1)
    client.begin_run("runB")
    with pytest.raises(StaleRunError):
        client.dynamic_push("t", np.array([1], np.int64), np.ones((1, 4), np.float32), update_id="runA/c1/0")
    assert _table_counters(client, "t")["pushes"] == 0.0
    assert not client.dynamic_push("t", np.array([1], np.int64), np.ones((1, 4), np.float32),
                                   update_id="runB/c1/0").duplicate


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_counted_pushes_equal_uncounted_ones_and_are_applied_once(client: PSClient, key_dtype: str) -> None:
    """Two tables, one fed each batch as one row per key occurrence (a request without counts, as older
    clients send it), the other the batch reduced (each key once, its rows summed, its count): identical
    answers, rows, counters and shards; a counted push sent again under its id is a duplicate."""
    cfg = _cfg("old", key_dtype=key_dtype, eviction=EvictionConfig(capacity=25, policy="lfu", ttl_steps=7))
    client.create_dynamic_table(cfg, 0, 1)
    client.create_dynamic_table(_cfg("new", key_dtype=key_dtype,
                                     eviction=EvictionConfig(capacity=25, policy="lfu", ttl_steps=7)), 0, 1)
    rng = np.random.default_rng(4)
    probe_ids = np.arange(80, dtype=np.int64)
    probe = probe_ids if key_dtype == "int64" else [f"k{i}" for i in probe_ids.tolist()]
    for step in range(30):
        ids = (rng.zipf(1.2, size=48) % 80).astype(np.int64)
        keys = ids if key_dtype == "int64" else [f"k{i}" for i in ids.tolist()]
        grads = (rng.standard_normal((48, 4)) * 10.0 ** rng.integers(-3, 4, size=(48, 1))).astype(np.float32)
        old = client.dynamic_push("old", keys, grads, update_id=f"o{step}")
        red = reduce_push(validate_keys(keys, key_dtype), grads)
        assert len(red.keys) < len(keys)
        new = client.dynamic_push("new", red.keys, red.grads, update_id=f"n{step}", counts=red.counts)
        assert (old.applied, old.refused, old.inserted, old.evicted) == (
            new.applied, new.refused, new.inserted, new.evicted)
        again = client.dynamic_push("new", red.keys, 3 * red.grads, update_id=f"n{step}", counts=red.counts)
        assert again.duplicate
        lo, ln = client.dynamic_lookup("old", probe), client.dynamic_lookup("new", probe)
        assert np.array_equal(lo[0], ln[0]) and np.array_equal(lo[1], ln[1])
    assert _table_counters(client, "old") == _table_counters(client, "new")
    st = _table_counters(client, "old")
    assert st["pushes"] == 30 and st["evictions"] > 0 and st["admissions_refused"] > 0


def test_malformed_counts_are_refused_with_invalid_argument_and_change_nothing(client: PSClient) -> None:
    client.create_dynamic_table(_cfg(admission=AdmissionConfig(min_count=2)), 0, 1)
    client.dynamic_push("t", np.array([1, 2, 2, 3], np.int64), np.ones((4, 4), np.float32), update_id="ok")
    snapshot = client.dynamic_lookup("t", np.arange(10, dtype=np.int64))
    counters = _table_counters(client, "t")

    def req(keys: list[int], counts: list[int]) -> ps_pb2.DynamicPushRequest:
        r = ps_pb2.DynamicPushRequest(table="t", update_id="bad")
        codec.tensor_to_proto(np.asarray(keys, np.int64), r.keys.ids)
        codec.tensor_to_proto(np.ones((len(keys), 4), np.float32), r.grads)
        r.counts.extend(counts)
        return r

    for r in [req([1, 2], [1]), req([1, 2], [1, 1, 1]), req([1, 2], [1, 0]), req([1, 2], [2, -1]),
              req([1, 1], [1, 1]), req([1, 2], [1 << 62, 1 << 62]), req([1, 2], [(1 << 63) - 1, 1])]:
        with pytest.raises(InvalidRequestError) as e:
            _raw_push(client, r)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidRequestError):  # the client refuses a count list it cannot send
        client.dynamic_push("t", np.array([1, 2], np.int64), np.ones((2, 4), np.float32), counts=np.ones(1, np.int64))
    after = client.dynamic_lookup("t", np.arange(10, dtype=np.int64))
    assert np.array_equal(after[0], snapshot[0]) and np.array_equal(after[1], snapshot[1])
    assert _table_counters(client, "t") == counters
    # Without counts, repeated keys are one row per occurrence, as always; the refused id applies now.
    assert client.dynamic_push("t", np.array([5, 5], np.int64), np.ones((2, 4), np.float32),
                               update_id="bad").inserted == 1


def _raw_push(client: PSClient, req: ps_pb2.DynamicPushRequest) -> ps_pb2.DynamicPushResponse:
    return client._call(client._dyn_push, req, 10.0)


def test_hostile_input_is_refused_with_typed_errors_and_changes_nothing(ps_server: ParameterServer,
                                                                         client: PSClient) -> None:
    cfg = _cfg(admission=AdmissionConfig(), eviction=EvictionConfig(), max_bytes=10 * _cfg().row_bytes())
    client.create_dynamic_table(cfg, 0, 1)
    keys = np.arange(5, dtype=np.int64)
    client.dynamic_push("t", keys, np.ones((5, 4), np.float32), update_id="ok")
    snapshot = client.dynamic_lookup("t", np.arange(20, dtype=np.int64))
    counters = _table_counters(client, "t")
    g1 = np.ones((1, 4), np.float32)

    def req(**kw: object) -> ps_pb2.DynamicPushRequest:
        r = ps_pb2.DynamicPushRequest(table="t", update_id="bad")
        codec.tensor_to_proto(kw.pop("grads", g1), r.grads)
        if "ids" in kw:
            codec.tensor_to_proto(kw.pop("ids"), r.keys.ids)
        if "strings" in kw:
            r.keys.strings.extend(kw.pop("strings"))  # type: ignore[arg-type]
            r.keys.is_string = bool(kw.pop("is_string", True))
        return r

    cases: list[tuple[ps_pb2.DynamicPushRequest, type[Exception], grpc.StatusCode]] = [
        (req(ids=np.array([1.5], np.float32)), DTypeMismatchError, grpc.StatusCode.INVALID_ARGUMENT),
        (req(strings=["a"]), DTypeMismatchError, grpc.StatusCode.INVALID_ARGUMENT),
        (req(ids=np.array([[1]], np.int64)), ShapeMismatchError, grpc.StatusCode.INVALID_ARGUMENT),
        (req(ids=np.array([1, 2], np.int64)), ShapeMismatchError, grpc.StatusCode.INVALID_ARGUMENT),
        (req(ids=np.array([1], np.int64), grads=np.ones((1, 4), np.int32)), DTypeMismatchError,
         grpc.StatusCode.INVALID_ARGUMENT),
        (req(ids=np.array([1], np.int64), grads=np.full((1, 4), np.nan, np.float32)), InvalidRequestError,
         grpc.StatusCode.INVALID_ARGUMENT),
        (req(ids=np.array([1], np.int64), strings=["a"]), InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
        (req(strings=["a"], is_string=False), InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
        (req(), InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
        (req(ids=np.arange(100, 106, dtype=np.int64), grads=np.ones((6, 4), np.float32)), PayloadTooLargeError,
         grpc.StatusCode.RESOURCE_EXHAUSTED),
    ]
    truncated = req(ids=np.array([1], np.int64))
    truncated.keys.ids.data = truncated.keys.ids.data[:3]
    cases.append((truncated, InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT))
    unknown = req(ids=np.array([1], np.int64))
    unknown.table = "nope"
    cases.append((unknown, VariableNotFoundError, grpc.StatusCode.NOT_FOUND))
    for r, err, code in cases:
        with pytest.raises(err) as e:
            _raw_push(client, r)
        assert e.value.code == code, (r, e.value)
    with pytest.raises(DTypeMismatchError):
        client.dynamic_lookup("t", ["a"])
    with pytest.raises(VariableExistsError) as e2:
        client.create_dynamic_table(_cfg(seed=8), 0, 1)
    assert e2.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(InvalidRequestError):
        client._call(client._dyn_create, ps_pb2.CreateDynamicTableRequest(config_json="{", num_shards=1), 10.0)
    with pytest.raises(InvalidRequestError):
        client.create_dynamic_table(_cfg("x"), 2, 2)
    # Nothing changed: rows, counters; and the refused id was not recorded (a corrected retry applies).
    after = client.dynamic_lookup("t", np.arange(20, dtype=np.int64))
    assert np.array_equal(after[0], snapshot[0]) and np.array_equal(after[1], snapshot[1])
    assert _table_counters(client, "t") == counters
    assert not client.dynamic_push("t", np.array([1], np.int64), g1, update_id="bad").duplicate
