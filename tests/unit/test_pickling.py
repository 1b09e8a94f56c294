"""jaxdist.proto.pickling: code that travels keeps its file name (so remote tracebacks show source lines)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxdist.proto import pickling

pytestmark = pytest.mark.timeout(60)

#: Loads the pickle on stdin in a fresh interpreter (as a worker does: nothing of this test module
#: is importable there) and reports what its code objects say.
_LOADER = """
import json, pickle, sys, traceback
outer, Local = pickle.loads(sys.stdin.buffer.read())
inner = next(c for c in outer.__code__.co_consts if hasattr(c, "co_filename"))
try:
    Local("x").boom()
except Exception as e:
    text = "".join(traceback.format_exception(e))
print(json.dumps({"value": outer(2), "outer": [outer.__code__.co_filename, outer.__code__.co_firstlineno],
                  "inner": inner.co_filename, "method": Local.boom.__code__.co_filename, "traceback": text}))
"""


def test_functions_classes_and_nested_code_keep_their_file_and_lines() -> None:
    scale = 3

    def outer(x: int) -> int:
        inner = lambda y: y * scale  # noqa: E731 - a nested code object in co_consts
        return inner(x)

    class Local(Exception):
        def boom(self) -> None:
            raise self

    r = subprocess.run([sys.executable, "-c", _LOADER], input=pickling.dumps((outer, Local)), capture_output=True,
                       timeout=50)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    got = json.loads(r.stdout)
    assert got["value"] == 6
    assert got["outer"] == [__file__, outer.__code__.co_firstlineno]
    assert got["inner"] == got["method"] == __file__
    assert f'File "{__file__}"' in got["traceback"] and "raise self" in got["traceback"]  # found by its file


def test_payloads_are_deterministic_for_one_definition() -> None:
    def fn(a: int) -> int:
        return a + 1

    assert pickling.dumps(fn) == pickling.dumps(fn)  # the workers cache functions by the payload's digest


def test_a_per_worker_input_error_travels_with_its_cause() -> None:
    """PerWorkerInputError pickles its __cause__ (exceptions do not by themselves): the consumer's error
    on the coordinator still says what the dataset function raised."""
    import pickle

    from jaxdist.errors import PerWorkerInputError

    err = PerWorkerInputError("per-worker input 3 failed to build on worker:1: KeyError: 'x'", 3, "worker:1")
    err.__cause__ = KeyError("x")
    back = pickle.loads(pickling.dumps(err))
    assert type(back) is PerWorkerInputError and str(back) == str(err)
    assert (back.resource_id, back.task) == (3, "worker:1")
    assert isinstance(back.__cause__, KeyError) and back.__cause__.args == ("x",)
