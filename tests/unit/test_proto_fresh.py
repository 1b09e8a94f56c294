import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_public_api_is_pinned() -> None:
    import jaxdist

    for name in ("ParameterServerStrategy", "ClusterCoordinator", "LocalCluster", "RemoteValue", "PerWorkerValues",
                 "SimpleClusterResolver", "TFConfigClusterResolver", "FixedShardsPartitioner", "MinSizePartitioner",
                 "MaxSizePartitioner", "ShardedVariable", "create_variables", "pull", "apply_gradients",
                 "current_worker_index", "InputContext", "PSUnavailableError"):
        assert name in jaxdist.__all__ and hasattr(jaxdist, name), name


def test_no_generic_top_level_modules_installed() -> None:
    """Only `jaxdist` is importable; the repo folders are not top-level packages when run elsewhere."""
    code = "import importlib.util as u; print([m for m in ('coordinator','worker','proto','ps_server','sync','keras_integration','base','transport','tools') if u.find_spec(m)])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.stdout.strip() == "[]", r.stdout
