"""bench/recsys.py: its run order and summary logic, and its jaxdist side run end to end in a tiny configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def recsys():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH))
    try:
        import recsys

        yield recsys
    finally:
        sys.path.remove(str(BENCH))


def test_schedule_alternates_who_goes_first_and_runs_lazy_after_exact_adam(recsys: Any) -> None:
    order = recsys.schedule(2, ["adam", "adam_lazy", "sgd"], ["jaxdist", "tf"])
    assert order == [
        (0, "tf", "adam"), (0, "jaxdist", "adam"), (0, "jaxdist", "adam_lazy"),
        (0, "jaxdist", "sgd"), (0, "tf", "sgd"),
        (1, "jaxdist", "adam"), (1, "jaxdist", "adam_lazy"), (1, "tf", "adam"),
        (1, "tf", "sgd"), (1, "jaxdist", "sgd"),
    ]
    assert recsys.schedule(1, ["adam_lazy"], ["jaxdist"]) == [(0, "jaxdist", "adam_lazy")]
    assert recsys.schedule(1, ["adam", "adam_lazy"], ["tf"]) == [(0, "tf", "adam")]


def test_summary_takes_medians_and_compares_lazy_adam_with_tf_adam(recsys: Any) -> None:
    def run(system: str, config: str, eps: float, pulled: int | None = None) -> dict[str, Any]:
        return dict(system=system, config=config, examples_per_s=eps, bytes_pulled_per_step=pulled,
                    bytes_pushed_per_step=pulled, distinct_ids_per_step=10.0 if pulled else None,
                    distinct_row_bytes_per_step=640 if pulled else None)

    runs = [run("tf", "adam", 100), run("tf", "adam", 300), run("tf", "adam", 200),
            run("jaxdist", "adam", 250, 1000), run("jaxdist", "adam", 350, 3000), run("jaxdist", "adam", 900, 2000),
            run("jaxdist", "adam_lazy", 700, 5), run("tf", "sgd", 10)]
    rows = {r["config"]: r for r in recsys.summarize(runs, ["adam", "adam_lazy", "sgd"])}
    adam, lazy, sgd = rows["adam"], rows["adam_lazy"], rows["sgd"]
    assert adam["tf_examples_per_s"] == 200 and adam["jaxdist_examples_per_s"] == 350
    assert adam["ratio_jaxdist_to_tf"] == 1.75 and adam["target"] == 1.5 and adam["met"] is True
    assert adam["bytes_pulled_per_step"] == 2000 and adam["tf_rounds"] == [100, 300, 200]
    assert lazy["tf_config"] == "adam" and lazy["ratio_jaxdist_to_tf"] == 3.5 and lazy["met"] is True
    assert sgd["jaxdist_examples_per_s"] is None and sgd["ratio_jaxdist_to_tf"] is None and sgd["met"] is None
    table = recsys.format_table(list(rows.values()))
    assert "adam_lazy" in table and "1.75" in table


def test_cardinalities_have_26_tables_the_largest_first(recsys: Any) -> None:
    cards = recsys.cardinalities(10_000_000)
    assert len(cards) == 26 and cards[0] == 10_000_000 and max(cards[1:]) < cards[0]
    assert max(recsys.cardinalities(1000)) == 1000


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
@pytest.mark.slow
def test_jaxdist_side_moves_the_batch_rows_not_the_table(tmp_path: Path) -> None:
    """A tiny run of jaxdist's side (no TF): 2 PS + 2 workers, SGD, a 100K-row table.

    Every step pulls the dense layers plus exactly the rows of the batch's distinct ids (a few hundred KB),
    not the 6.4 MB table. (SGD: its PS steps compile fast. With Adam, the first pushes of the 26 tables'
    steps were seen to pass the PS client's 10 s push deadline on the loaded 2-core machine.)
    """
    out = tmp_path / "recsys.jsonl"
    r = subprocess.run(
        [sys.executable, str(BENCH / "recsys.py"), "--system", "jaxdist", "--rounds", "1", "--configs", "sgd",
         "--largest", "100000", "--batch", "64", "--batches", "2", "--steps", "4", "--spe", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=270, env={**os.environ, "JAX_PLATFORMS": "cpu", "KERAS_BACKEND": "jax"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["kind"] for rec in lines] == ["config", "run", "summary"], lines
    config, run, summary = lines
    assert config["tables"] == 26 and config["systems"] == ["jaxdist"] and config["largest"] == 100_000
    assert run["system"] == "jaxdist" and run["config"] == "sgd" and run["examples_per_s"] > 0
    rows = run["distinct_row_bytes_per_step"]
    assert rows == pytest.approx(run["distinct_ids_per_step"] * 64, abs=64)
    # The dense layers and the distinct rows, each step: the ids of a step's batches are known exactly.
    assert run["bytes_pulled_per_step"] == pytest.approx(run["dense_param_bytes"] + rows, rel=0.01)
    assert run["bytes_pushed_per_step"] >= run["dense_param_bytes"] + rows
    assert run["bytes_pushed_per_step"] < run["dense_param_bytes"] + 2 * rows
    assert run["bytes_pulled_per_step"] < 100_000 * 64 / 4  # not the largest table
    assert summary["config"] == "sgd" and summary["jaxdist_examples_per_s"] == run["examples_per_s"]
    assert summary["ratio_jaxdist_to_tf"] is None and summary["met"] is None
