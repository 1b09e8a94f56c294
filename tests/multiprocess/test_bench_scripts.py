"""The TF-comparison bench scripts: jaxdist_workloads.py's JSON schema, compare_tf.py's summary logic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def compare_tf():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH))
    try:
        import compare_tf

        yield compare_tf
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.timeout(180)
@pytest.mark.multiprocess
@pytest.mark.slow
def test_jaxdist_workloads_noop_json_schema() -> None:
    r = subprocess.run(
        [sys.executable, str(BENCH / "jaxdist_workloads.py"), "--workload", "noop", "--repeats", "1", "--workers", "1",
         "--noop-closures", "200"],
        capture_output=True, text=True, timeout=150, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 2, r.stdout
    info, rec = lines
    assert info["system"] == "jaxdist" and "jaxdist_version" in info and "workload" not in info
    assert isinstance(info["transfer_dtype_supported"], bool)
    assert rec["system"] == "jaxdist"
    assert rec["workload"] == "noop_closures_per_s"
    assert rec["workers"] == 1 and rec["ps"] == 2 and rec["closures"] == 200
    assert rec["transport"] in ("shm", "tcp", "grpc")
    assert isinstance(rec["median"], float) and rec["median"] > 0
    assert len(rec["runs"]) == 1 and rec["runs"][0] == rec["median"]


@pytest.mark.timeout(240)
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("bulk", ["float32", "bfloat16"])
def test_jaxdist_workloads_pull_push_records_say_what_travelled(bulk: str) -> None:
    r = subprocess.run(
        [sys.executable, str(BENCH / "jaxdist_workloads.py"), "--workload", "all", "--repeats", "1", "--workers", "1",
         "--noop-closures", "50", "--mlp-steps", "4", "--size-mb", "1", "--bulk-dtype", bulk],
        capture_output=True, text=True, timeout=210, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    recs = {rec["workload"]: rec for rec in map(json.loads, r.stdout.splitlines()[1:])}
    pull, push = recs["pull_1MB_MBps"], recs["push_1MB_MBps"]
    assert pull["median"] > 0 and push["median"] > 0
    if bulk == "float32":
        assert "wire_dtype" not in pull and push["push_op"] == "assign_add"
    else:
        assert pull["wire_dtype"] == push["wire_dtype"] == "bfloat16" and push["push_op"] == "apply_gradient(sgd 1.0)"
    assert "wire_dtype" not in recs["mlp_steps_per_s"]  # the MLP's dtypes are its own options


@pytest.mark.timeout(150)
@pytest.mark.parametrize("argv, says", [
    (["--staleness", "-1"], "give async or an int >= 0"),
    (["--staleness", "sync"], "give async or an int >= 0"),
    (["--staleness", "0", "--workload", "noop"], "--staleness measures the MLP only"),
    (["--staleness", "1", "--workload", "mlp", "--mlp-mode", "prefetch"], "need --mlp-mode pull_push"),
    (["--given-cluster", "--workers", "3"], "with --given-cluster the counts are the given cluster's"),
    (["--given-cluster", "--ps", "1"], "with --given-cluster the counts are the given cluster's"),
])
def test_jaxdist_workloads_refuses_what_it_cannot_measure(argv: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, str(BENCH / "jaxdist_workloads.py"), *argv], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert says in r.stderr and '"workload"' not in r.stdout  # refused before any cluster was started


def _records(tf: dict[str, list[float]], jd: dict[str, list[float]], ref: dict[str, list[float]]) -> list[dict]:
    out = []
    for system, table in (("tf", tf), ("jaxdist", jd), ("reference", ref)):
        for workload, vals in table.items():
            for r, v in enumerate(vals, 1):
                out.append({"system": system, "workload": workload, "median": v, "runs": [v], "round": r})
    out.append({"system": "tf", "tf_version": "2.x"})  # info lines carry no workload: ignored
    return out


@pytest.mark.timeout(30)
def test_summary_medians_ratios_and_targets(compare_tf) -> None:  # type: ignore[no-untyped-def]
    records = _records(
        tf={"noop_closures_per_s": [1000, 900, 1100], "pull_64MB_MBps": [500, 400, 600],
            "push_64MB_MBps": [400, 400, 400], "mlp_steps_per_s": [20, 10, 30]},
        jd={"noop_closures_per_s": [6000, 4000, 5000], "pull_64MB_MBps": [800, 700, 900],
            "push_64MB_MBps": [700, 600, 650], "mlp_steps_per_s": [30, 31, 29]},
        ref={"raw_grpc_tiny_concurrent_calls_per_s": [3000, 3000, 3000], "raw_grpc_stream_down_MBps": [1000, 1000, 1000],
             "raw_grpc_stream_up_MBps": [1000, 700, 900], "plain_jax_mlp_steps_per_s": [60, 40, 50],
             "raw_grpc_tiny_sequential_calls_per_s": [1, 1, 1]},
    )
    rows = {r["workload"]: r for r in compare_tf.summarize(records)}
    assert list(rows) == ["noop_closures_per_s", "pull_64MB_MBps", "push_64MB_MBps", "mlp_steps_per_s"]

    noop = rows["noop_closures_per_s"]  # 5000 / 1000 = 5.0: exactly the 5x target; no reference target
    assert noop["tf_median"] == 1000 and noop["jaxdist_median"] == 5000
    assert noop["ratio_jaxdist_to_tf"] == 5.0 and noop["met_vs_tf"] is True
    assert noop["reference"] == "raw_grpc_tiny_concurrent_calls_per_s" and noop["ratio_jaxdist_to_reference"] == pytest.approx(5000 / 3000, abs=1e-3)
    assert noop["target_vs_reference"] is None and noop["met_vs_reference"] is None and noop["met"] is True

    pull = rows["pull_64MB_MBps"]  # 800/500 = 1.6 >= 1.5, 800/1000 = 0.8 >= 0.80
    assert pull["reference"] == "raw_grpc_stream_down_MBps"
    assert pull["ratio_jaxdist_to_tf"] == 1.6 and pull["ratio_jaxdist_to_reference"] == 0.8
    assert pull["met_vs_tf"] and pull["met_vs_reference"] and pull["met"] is True
    assert pull["tf_rounds"] == [500, 400, 600] and pull["jaxdist_rounds"] == [800, 700, 900]

    push = rows["push_64MB_MBps"]  # 650/400 = 1.625 ok; 650/900 = 0.722 < 0.80
    assert push["reference"] == "raw_grpc_stream_up_MBps" and push["reference_median"] == 900
    assert push["met_vs_tf"] is True and push["met_vs_reference"] is False and push["met"] is False

    mlp = rows["mlp_steps_per_s"]  # 30/20 = 1.5 ok; 30/50 = 0.6 ok (boundaries inclusive)
    assert mlp["reference"] == "plain_jax_mlp_steps_per_s"
    assert mlp["ratio_jaxdist_to_tf"] == 1.5 and mlp["ratio_jaxdist_to_reference"] == 0.6 and mlp["met"] is True
    assert mlp["target_vs_tf"] == 1.5 and mlp["target_vs_reference"] == 0.60


@pytest.mark.timeout(30)
def test_summary_without_tf_and_tf_in_closure_timing(compare_tf) -> None:  # type: ignore[no-untyped-def]
    records = _records(tf={}, jd={"mlp_steps_per_s": [10.0], "pull_64MB_MBps": [100.0]},
                       ref={"plain_jax_mlp_steps_per_s": [50.0], "raw_grpc_stream_down_MBps": [100.0]})
    rows = {r["workload"]: r for r in compare_tf.summarize(records)}
    mlp = rows["mlp_steps_per_s"]
    assert mlp["tf_median"] is None and mlp["ratio_jaxdist_to_tf"] is None and mlp["met_vs_tf"] is None
    assert mlp["met_vs_reference"] is False and mlp["met"] is False  # a failed check wins over an unknown one
    pull = rows["pull_64MB_MBps"]
    assert pull["met_vs_reference"] is True and pull["met"] is None  # TF unknown, nothing failed
    assert rows["push_64MB_MBps"]["jaxdist_median"] is None and rows["push_64MB_MBps"]["met"] is None

    # TF's pull/push lines carry a coordinator-timed median and an in-closure one: the latter is used
    tf_pull = {"system": "tf", "workload": "pull_64MB_MBps", "median": 50.0, "median_in_closure": 80.0}
    tf_mlp = {"system": "tf", "workload": "mlp_steps_per_s", "median": 5.0, "median_in_closure": 99.0}
    rows = {r["workload"]: r for r in compare_tf.summarize(records + [tf_pull, tf_mlp])}
    assert rows["pull_64MB_MBps"]["tf_median"] == 80.0
    assert rows["mlp_steps_per_s"]["tf_median"] == 5.0
    assert "pull_64MB_MBps" in compare_tf.format_table(list(rows.values()))
    assert pull["jaxdist_transport"] is None and "moved tensors over" not in compare_tf.format_table([pull])

    # The transport jaxdist used is carried into every row and named under the table.
    shm = [dict(r, transport="shm") if r.get("system") == "jaxdist" else r for r in records]
    rows = compare_tf.summarize(shm)
    assert {r["jaxdist_transport"] for r in rows} == {"shm"}
    assert "jaxdist moved tensors over: shm" in compare_tf.format_table(rows)


@pytest.mark.timeout(30)
def test_round_order_alternates(compare_tf) -> None:  # type: ignore[no-untyped-def]
    assert compare_tf.round_order(1) == ["tf", "jaxdist", "references"]
    assert compare_tf.round_order(2) == ["jaxdist", "tf", "references"]
    assert compare_tf.round_order(3) == compare_tf.round_order(1)
