"""The suite's tiers, in one place: which tests the fast lane leaves out, and which are the lint step.

- ``pytest`` runs everything (the README's test command, CI).
- ``pytest -m "not slow"`` is the fast lane: every test module that has fast tests, each library
  module exercised, in under 3 minutes on the 2-core development machine.
- ``pytest -m lint`` is the static checks (ruff, mypy), which CI runs as a step of its own.

A test is ``slow`` when it takes more than a few seconds. Most say so with ``@pytest.mark.slow``
where they are defined; the ones below are marked here because their modules are otherwise fast
and the marker is about the tier, not the test's subject (a measured full run put each at 7 s or
more). Node ids are matched as prefixes, so a parametrized test is named once.
"""

from __future__ import annotations

import pytest

#: Tests of otherwise fast modules that take seconds each (subprocess clusters, compiles, hostile load).
SLOW: tuple[str, ...] = (
    "tests/hostile/test_hostile_starvation.py::",
    "tests/hostile/test_hostile_grpc.py::test_registrations_of_unreachable_workers_are_capped",
    "tests/unit/test_sync_training.py::test_default_strategy_variables_optimizer_match_plain_optax",
    "tests/unit/test_sync_training.py::test_metrics_match_sklearn_with_a_short_last_batch",
    "tests/multiprocess/test_elastic_and_data.py::test_partitioned_worker_is_detected_and_its_closure_retried",
    "tests/multiprocess/test_replication.py::test_counter_is_exact_despite_sigkill_of_primaries",
    "tests/multiprocess/test_recovery.py::test_coordinator_sigkill_and_restart_reaches_the_same_state",
    "tests/multiprocess/test_ps_staleness_failures.py::test_frozen_worker_is_dropped_after_the_failure_timeout",
    "tests/multiprocess/test_local_cluster.py::test_readme_example_trains",
    "tests/multiprocess/test_task_env.py::test_local_cluster_tasks_get_the_settings_up_front",
    # Covered in the fast lane by a sibling (the PS restored in-process in test_coordinator, a SIGKILLed
    # coordinator script in test_local_cluster, TLS on a PS process, the bf16 push, a shutdown exit code).
    "tests/multiprocess/test_recovery.py::test_ps_sigkill_mid_training_recovers_from_checkpoint",
    "tests/multiprocess/test_local_cluster.py::test_launch_runs_a_coordinator_script",
    "tests/multiprocess/test_local_cluster.py::test_nothing_left_when_coordinator_script_crashes",
    "tests/integration/test_tls.py::test_local_cluster_with_tls_trains",
    "tests/integration/test_transfer_dtype.py::test_mixed_precision_pull_halves_pulled_bytes",
    "tests/multiprocess/test_ps_staleness_failures.py::test_sigkilled_worker_is_dropped_and_synchronous_training_completes",
    "tests/multiprocess/test_lifecycle.py::test_coordinator_shutdown_code_is_every_tasks_exit_code[with_block_raises]",
    "tests/multiprocess/test_dynamic_embedding_processes.py::",
)

#: The static checks: their own CI step, and not in the fast lane (mypy alone takes ~25 s).
LINT: tuple[str, ...] = (
    "tests/unit/test_static_checks.py::",
)


def apply(items: list[pytest.Item]) -> None:
    """Add the ``slow`` / ``lint`` markers named above to the collected ``items``."""
    for item in items:
        nodeid = item.nodeid
        if nodeid.startswith(LINT):
            item.add_marker(pytest.mark.lint)
            item.add_marker(pytest.mark.slow)
        elif nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
