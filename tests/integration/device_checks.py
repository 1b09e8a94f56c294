"""Checks that need N fake CPU devices, run in ONE fresh subprocess per test module.

JAX fixes its device count when it starts and the pytest process runs with one CPU
device, so a module that needs 8 registers its checks on a :class:`DeviceChecks`,
runs itself as a script in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the module's
``check_results`` fixture, made by :meth:`DeviceChecks.results_fixture`, calls :meth:`DeviceChecks.collect`), and the subprocess
prints one JSON line ``{check: null | traceback}``; each test asserts on one check
with :func:`assert_passed`::

    CHECKS = DeviceChecks(__file__, "MY_RESULTS=", timeout=420)

    @CHECKS.check
    def mirrored_matches_one_device() -> None: ...

    check_results = CHECKS.results_fixture()

    @pytest.mark.parametrize("name", CHECKS.names())
    def test_on_8_fake_devices(name, check_results):
        assert_passed(check_results, name)

    if __name__ == "__main__":
        CHECKS.main()
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest

#: Variables that would make a check see a cluster, a TPU slice or a Keras backend of the
#: environment the tests were started in instead of the fake devices.
_CLUSTER_ENV = (
    "JAXDIST_TPU_FAKE_DEVICES", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_WORKER_ID",
    "TPU_ACCELERATOR_TYPE", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS", "TF_CONFIG", "JAXDIST_CLUSTER",
    "SLURM_JOB_ID", "KERAS_BACKEND",
)


def fake_devices_env(devices: int) -> dict[str, str]:
    """This process's environment with ``devices`` fake CPU devices and no cluster variables."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    for k in _CLUSTER_ENV:
        env.pop(k, None)
    return env


class DeviceChecks:
    """The checks of one test module, run by that module as a script in one subprocess.

    Args:
        script: the module's ``__file__`` (the subprocess runs it; its ``__main__`` calls :meth:`main`).
        prefix: marks the result line on the subprocess's stdout (unique per module).
        devices: fake CPU devices the subprocess gets.
        timeout: seconds the whole subprocess may take.
        setup: run once in the subprocess before the first check (imports that must come first).
    """

    def __init__(self, script: str, prefix: str, *, devices: int = 8, timeout: float = 420,
                 setup: Callable[[], None] | None = None) -> None:
        self.script, self.prefix, self.devices, self.timeout, self.setup = script, prefix, devices, timeout, setup
        self._checks: dict[str, Callable[[], None]] = {}

    def check(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Register ``fn`` as a check named after it (a decorator)."""
        self.add(fn.__name__, fn)
        return fn

    def add(self, name: str, fn: Callable[[], None]) -> None:
        """Register ``fn`` as the check ``name``."""
        if name in self._checks:
            raise ValueError(f"two checks are named {name!r}")
        self._checks[name] = fn

    def names(self) -> list[str]:
        return list(self._checks)

    def run(self, names: list[str]) -> dict[str, str | None]:
        """In the subprocess: run ``names`` in order; None for a pass, the traceback for a failure."""
        import jax

        if self.setup is not None:
            self.setup()
        assert jax.device_count() == self.devices, jax.devices()
        results: dict[str, str | None] = {}
        for name in names:
            try:
                self._checks[name]()
                results[name] = None
            except BaseException:  # noqa: BLE001 - report every failure to the parent
                results[name] = traceback.format_exc()
        return results

    def main(self) -> None:
        """The module's ``__main__``: run the checks named on the command line (default all), print the line."""
        print(self.prefix + json.dumps(self.run(sys.argv[1:] or self.names())), flush=True)

    def collect(self) -> dict[str, str | None]:
        """In pytest: run every check in one subprocess and return its results."""
        proc = subprocess.run([sys.executable, self.script, *self._checks], env=fake_devices_env(self.devices),
                              capture_output=True, text=True, timeout=self.timeout)
        for line in proc.stdout.splitlines():
            if line.startswith(self.prefix):
                results: dict[str, str | None] = json.loads(line[len(self.prefix):])
                return results
        raise AssertionError(f"check subprocess failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")

    def results_fixture(self) -> Any:
        """The module's ``check_results`` fixture (module scope: every check runs in one subprocess, once):
        ``check_results = CHECKS.results_fixture()`` at module level."""

        @pytest.fixture(scope="module", name="check_results")
        def check_results() -> dict[str, str | None]:
            return self.collect()

        return check_results


def assert_passed(results: dict[str, str | None], name: str) -> None:
    """Fail the calling test with the check's own traceback if ``name`` failed or did not run."""
    assert name in results, f"check {name} did not run"
    err = results[name]
    if err is not None:
        pytest.fail(f"{name} failed in the fake-device subprocess:\n{err}", pytrace=False)
