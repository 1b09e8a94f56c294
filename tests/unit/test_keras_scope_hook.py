"""strategy.scope() reaches Keras through the sync core's scope hooks, never through an import of jaxdist.keras.

- ``jaxdist.sync.hooks``: hooks are entered inside every ``strategy.scope()``, after the strategy became
  current and exited before it stops being current, in registration order; a name registered again
  keeps its place.
- ``jaxdist.keras_bridge.scope_hook`` (what ``import jaxdist`` registers): nothing while Keras is not
  imported; a warning, once, when Keras runs on another backend; on Keras's JAX backend it imports
  ``jaxdist.keras``, whose own hook takes over (in a subprocess: the pytest process stays Keras-free).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

import jaxdist
from jaxdist import keras_bridge
from jaxdist.sync import hooks

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Register test hooks ``t1`` and ``t2`` (in that order) that log their enters and exits; removed after."""
    log: list[str] = []

    def make(name: str) -> Any:
        @contextlib.contextmanager
        def hook(strategy: Any) -> Iterator[None]:
            log.append(f"{name} enter {type(jaxdist.get_strategy()).__name__}")
            try:
                yield
            finally:
                log.append(f"{name} exit {type(jaxdist.get_strategy()).__name__}")

        return hook

    hooks.register_scope_hook("t1", make("t1"))
    hooks.register_scope_hook("t2", make("t2"))
    try:
        yield log
    finally:
        hooks.unregister_scope_hook("t1")
        hooks.unregister_scope_hook("t2")


_FRESH_IMPORT = r"""
import sys
import jaxdist
from jaxdist import keras_bridge
from jaxdist.sync import hooks
print("RESULT", hooks.scope_hooks()[keras_bridge.SCOPE_HOOK] is keras_bridge.scope_hook, "jaxdist.keras" in sys.modules)
"""


def test_import_jaxdist_registers_the_bridge() -> None:
    # In a fresh interpreter: in this one an earlier test may have imported jaxdist.keras, whose own
    # hook then replaced the bridge's (as it should).
    assert _run(_FRESH_IMPORT, None) == ["True", "False"]


def test_hooks_are_entered_inside_every_scope_in_order(registered: list[str]) -> None:
    strategy = jaxdist.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        assert registered == ["t1 enter OneDeviceStrategy", "t2 enter OneDeviceStrategy"]
    assert registered[2:] == ["t2 exit OneDeviceStrategy", "t1 exit OneDeviceStrategy"]
    assert jaxdist.get_strategy() is not strategy


def test_an_error_in_the_block_passes_through_the_hooks(registered: list[str]) -> None:
    strategy = jaxdist.OneDeviceStrategy("/cpu:0")
    with pytest.raises(KeyError, match="boom"), strategy.scope():
        raise KeyError("boom")
    assert registered[-2:] == ["t2 exit OneDeviceStrategy", "t1 exit OneDeviceStrategy"]
    assert jaxdist.get_strategy() is not strategy


def test_registering_a_name_again_replaces_it_in_place(registered: list[str]) -> None:
    order = list(hooks.scope_hooks())
    hooks.register_scope_hook("t1", lambda strategy: contextlib.nullcontext())
    assert list(hooks.scope_hooks()) == order
    with jaxdist.OneDeviceStrategy("/cpu:0").scope():
        pass
    assert registered == ["t2 enter OneDeviceStrategy", "t2 exit OneDeviceStrategy"]
    removed = hooks.unregister_scope_hook("t2")
    assert removed is not None and "t2" not in hooks.scope_hooks()
    assert hooks.unregister_scope_hook("t2") is None


def test_a_hook_must_be_callable() -> None:
    with pytest.raises(TypeError, match="must be callable"):
        hooks.register_scope_hook("t3", None)  # type: ignore[arg-type]
    assert "t3" not in hooks.scope_hooks()


def test_the_bridge_does_nothing_without_keras(monkeypatch: pytest.MonkeyPatch) -> None:
    # The bridge itself (the registered hook may be jaxdist.keras's own if an earlier test imported it).
    monkeypatch.delitem(sys.modules, "keras", raising=False)
    monkeypatch.delitem(sys.modules, "jaxdist.keras", raising=False)
    with keras_bridge.scope_hook(jaxdist.OneDeviceStrategy("/cpu:0")):
        pass
    assert "keras" not in sys.modules and "jaxdist.keras" not in sys.modules


def test_the_bridge_warns_once_when_keras_runs_on_another_backend(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    fake = types.ModuleType("keras")
    fake.config = types.SimpleNamespace(backend=lambda: "torch")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "keras", fake)
    monkeypatch.setattr(keras_bridge, "_warned_backend", False)
    monkeypatch.delitem(sys.modules, "jaxdist.keras", raising=False)
    strategy = jaxdist.OneDeviceStrategy("/cpu:0")
    with caplog.at_level(logging.WARNING, logger="jaxdist.keras_bridge"):
        # The bridge itself (the registered hook may be jaxdist.keras's own if an earlier test imported it).
        with keras_bridge.scope_hook(strategy):
            pass
        with keras_bridge.scope_hook(strategy):
            pass
    warnings = [r.getMessage() for r in caplog.records if r.name == "jaxdist.keras_bridge"]
    assert len(warnings) == 1, warnings
    assert "'torch' backend" in warnings[0] and "OneDeviceStrategy.scope() are NOT distributed" in warnings[0]
    assert "jaxdist.keras" not in sys.modules


_KERAS_FIRST = r"""
import sys
import keras  # on its JAX backend (KERAS_BACKEND=jax), before jaxdist and without jaxdist.keras
import jaxdist
from jaxdist.sync import hooks

before = hooks.scope_hooks()["keras"].__module__
with jaxdist.OneDeviceStrategy("/cpu:0").scope():
    inside = type(keras.distribution.distribution()).__name__
after = hooks.scope_hooks()["keras"].__module__
print("RESULT", before, inside, after, "jaxdist.keras" in sys.modules)
"""

_NO_KERAS = r"""
import sys
import jaxdist
with jaxdist.OneDeviceStrategy("/cpu:0").scope():
    pass
print("RESULT", "keras" in sys.modules, "jaxdist.keras" in sys.modules)
"""


def _run(code: str, keras_backend: str | None) -> list[str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("KERAS_BACKEND", None)
    if keras_backend is not None:
        env["KERAS_BACKEND"] = keras_backend
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1].split()[1:]


def test_a_program_without_keras_never_imports_it() -> None:
    assert _run(_NO_KERAS, None) == ["False", "False"]


@pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs the keras extra: pip install 'jaxdist[keras]'")
def test_keras_imported_first_on_jax_is_distributed_through_the_bridge() -> None:
    """As before the hook registry: a scope entered once Keras is in use makes the strategy's distribution
    current, importing jaxdist.keras, whose hook then replaces the bridge's."""
    assert _run(_KERAS_FIRST, "jax") == ["jaxdist.keras_bridge", "StrategyDistribution", "jaxdist.keras.scope", "True"]
