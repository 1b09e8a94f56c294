"""``jaxdist.Checkpoint`` for the synchronous strategies (and for no strategy at all).

Same on-disk format as the parameter-server strategy's checkpoints (see
:mod:`jaxdist.checkpoint`): a directory ``ckpt-<step>/`` with one ``.npz``
(``param/<name>``, ``opt/<name>/<i>``) and ``manifest.json`` written last
(shapes, one "shard" per variable at row 0, sha256 of the file, step,
metadata), renamed into place, so a crash leaves the previous checkpoint
intact. Hence checkpoints move between strategies: a PS checkpoint (sharded
over several PS) restores into a MirroredStrategy (shards concatenated), a
Mirrored one into a ParameterServerStrategy (each PS reads its rows), and
either is read with no strategy at all (:func:`jaxdist.checkpoint.load`, or
``jaxdist.Checkpoint(None)`` over default-strategy variables).

What is saved: every variable created with ``checkpoint=True`` (the
default: model parameters, ``optimizer/iterations``), and each
:class:`jaxdist.Optimizer`'s state, per parameter: ``opt/<param>/<i>`` is
leaf ``i`` of ``tx.init(param)``'s state, exactly what a PS holds next to a
variable. Metrics are not saved (as in TF's custom-loop tutorial, whose
checkpoint holds the model and the optimizer).

MultiWorkerMirroredStrategy: every process calls ``save``; the variables are
replicated, so process 0 writes the whole checkpoint from its copy while the
others wait at a barrier, and every process learns whether it succeeded: one
consistent checkpoint per job, never pieces from different processes.
``restore`` reads the files on every process: the directory must be on a
filesystem all processes share (as for TF's MultiWorkerMirroredStrategy);
the processes compare the manifest's digest and refuse to go on if they read
different checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from typing import Any

import jax
import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.files import AtomicFile
from jaxdist.sync import context as ctx_lib
from jaxdist.sync.optimizer import Optimizer
from jaxdist.sync.strategy import Strategy
from jaxdist.sync.variables import SyncVariable

logger = logging.getLogger(__name__)

__all__ = ["is_sync_strategy", "save", "restore"]

FILE_NAME = "vars-0.npz"


def is_sync_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` holds synchronous variables (every strategy but the PS one)."""
    return strategy is None or isinstance(strategy, Strategy)


def _strategy(ckpt: Any) -> Strategy:
    s = ckpt.strategy if ckpt.strategy is not None else ctx_lib.get_strategy()
    if not isinstance(s, Strategy):
        raise ConfigurationError(
            f"{type(s).__name__} does not hold synchronous variables: pass Checkpoint the strategy whose variables "
            "to save"
        )
    return s


def _host(x: Any) -> np.ndarray:
    """A replicated value on the host (in a multi-process job, this process's copy)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _is_writer(strategy: Strategy) -> bool:
    return jax.process_index() == min(strategy.engine.process_ids)


def _multi(strategy: Strategy) -> bool:
    return strategy.engine.multi_process


def _agree(strategy: Strategy, value: int, what: str) -> int:
    """Process 0's ``value`` on every process (a barrier when the job has several processes)."""
    if not _multi(strategy):
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def _dtype_name(dt: np.dtype) -> str:
    return dt.name if dt.kind == "V" or dt.name == "bfloat16" else dt.str


def _check_no_ledger(ckpt: Any) -> None:
    if ckpt.ledger is not None:
        raise ConfigurationError(
            "Checkpoint(ledger=...) saves a parameter-server DataLedger (exactly-once data across workers); "
            "a synchronous strategy has no ledger: every process iterates the same batches. Drop ledger="
        )


def _live_optimizers(strategy: Strategy, include_unbuilt: bool = False) -> list[Optimizer]:
    """Optimizers whose parameters are the strategy's registered variables of their names (not replaced since)."""
    registry = strategy.engine.variables
    out = []
    for opt in strategy.engine.optimizers():
        params = opt.parameters
        if params is None:
            if include_unbuilt:
                out.append(opt)
            continue
        if all(registry.get(v.name) is v for v in params):
            out.append(opt)
    return out


def _collect(strategy: Strategy) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    """Arrays to write and the manifest's variables section."""
    per_var_opt: dict[str, list[Any]] = {}
    for opt in _live_optimizers(strategy):
        state = opt.per_variable_state()
        if state:
            per_var_opt.update(state)
    arrays: dict[str, np.ndarray] = {}
    variables: dict[str, dict[str, Any]] = {}
    with ctx_lib.outside_frames():
        for name, var in strategy.engine.variables.items():
            if not var.checkpointed:
                continue
            value = _host(var.value())
            arrays[f"param/{name}"] = value
            leaves = per_var_opt.get(name, [])
            for i, leaf in enumerate(leaves):
                arrays[f"opt/{name}/{i}"] = _host(leaf)
            variables[name] = {
                "shape": list(value.shape),
                "dtype": _dtype_name(value.dtype),
                "shards": [
                    {"name": name, "file": FILE_NAME, "row_start": 0, "shape": list(value.shape), "optimizer_leaves": len(leaves)}
                ],
            }
    return arrays, variables


def save(ckpt: Any, path: str) -> str:
    """Write ``ckpt``'s strategy's variables and optimizer states to the directory ``path`` (must not exist).

    ``Checkpoint.write(path)`` (and ``Checkpoint.save(prefix)``, which numbers ``path``) call this.
    """
    from jaxdist.checkpoint import FORMAT_VERSION, MANIFEST
    from jaxdist.ps_server.checkpoint_io import write_npz_atomic

    _check_no_ledger(ckpt)
    strategy = _strategy(ckpt)
    if ctx_lib.in_replica_fn():
        raise RuntimeError("Checkpoint.save() was called inside strategy.run: save in cross-replica context")
    path = os.path.abspath(path)
    arrays, variables = _collect(strategy)  # every process (cheap: replicated values, no collectives)
    ok, err = 1, None
    if _is_writer(strategy):
        t0 = time.perf_counter()
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            if os.path.exists(path):
                raise FileExistsError(f"checkpoint {path} already exists")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            sha, nbytes = write_npz_atomic(tmp, FILE_NAME, arrays)
            manifest = {
                "format": FORMAT_VERSION,
                "step": int(ckpt.step),
                "save_counter": int(ckpt.save_counter),
                "created": time.time(),
                "num_ps": 0,
                "writer": type(strategy).__name__,
                "files": {FILE_NAME: {"sha256": sha, "bytes": nbytes}},
                "variables": variables,
                "ledger": None,
                "metadata": ckpt.metadata,
            }
            with AtomicFile(os.path.join(tmp, MANIFEST), text=True) as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
            logger.info("saved %s (%.1f MB in %.2fs)", path, nbytes / 2**20, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported to every process below, then re-raised
            shutil.rmtree(tmp, ignore_errors=True)
            ok, err = 0, e
    if not _agree(strategy, ok, "save"):
        if err is not None:
            raise err
        raise ConfigurationError(f"process 0 failed to write checkpoint {path}; see its log")
    return path


def _digest(path: str) -> int:
    from jaxdist.checkpoint import MANIFEST

    with open(os.path.join(path, MANIFEST), "rb") as f:
        return int.from_bytes(hashlib.sha256(f.read()).digest()[:4], "little") & 0x7FFFFFFF


def restore(ckpt: Any, path: str, variables: list[str] | None = None) -> None:
    """Restore ``ckpt``'s strategy's variables (all, or the named ones) and optimizer states from ``path``.

    ``path`` may come from any strategy (PS shards are concatenated). As TF's
    ``restore``, what matches is restored and a variable the checkpoint lacks
    (e.g. the optimizer's ``iterations`` in a PS checkpoint) keeps its value,
    with a warning naming it; a checkpoint matching none of the variables,
    or lacking one of those named in ``variables=[...]``, raises
    ConfigurationError.
    Optimizer state of an optimizer not built yet is kept and applied when it
    is built (TF's deferred restoration).
    """
    from jaxdist.checkpoint import load

    _check_no_ledger(ckpt)
    strategy = _strategy(ckpt)
    if ctx_lib.in_replica_fn():
        raise RuntimeError("Checkpoint.restore() was called inside strategy.run: restore in cross-replica context")
    if _multi(strategy):
        mine = _digest(path)
        from jax.experimental import multihost_utils

        all_d = np.asarray(multihost_utils.process_allgather(np.int32(mine))).reshape(-1)
        if len(set(all_d.tolist())) != 1:
            raise ConfigurationError(
                f"the processes read different checkpoints at {path}: put the checkpoint directory on a filesystem "
                "every process shares"
            )
    data = load(path, with_optimizer_state=True)
    saved = data["variables"]
    registry = strategy.engine.variables
    names = variables if variables is not None else [n for n, v in registry.items() if v.checkpointed]
    missing = [n for n in names if n not in saved]
    if names and len(missing) == len(names):
        raise ConfigurationError(
            f"checkpoint {path} holds none of {type(strategy).__name__}'s variables (it has {sorted(saved)[:6]}, "
            f"the strategy {names[:6]}): create the variables with the names they were saved under"
        )
    if variables is not None and missing:
        raise ConfigurationError(f"checkpoint {path} has no variable(s) {missing}")
    if missing:
        logger.warning(
            "checkpoint %s has no variable(s) %s: they keep their current values (as TF's restore, which restores "
            "what matches)", path, missing,
        )
    with ctx_lib.outside_frames():
        for name in names:
            var: SyncVariable | None = registry.get(name)
            if var is None:
                raise ConfigurationError(f"{type(strategy).__name__} has no variable {name!r}")
            value = saved.get(name)
            if value is None:
                continue
            if tuple(value.shape) != var.shape:
                raise ConfigurationError(f"variable {name!r} is {list(var.shape)} here but {list(value.shape)} in {path}")
            var.assign(value.astype(var.dtype), read_value=False)
        opt_state = data.get("optimizer_state") or {}
        for opt in _live_optimizers(strategy, include_unbuilt=True):
            params = opt.parameters
            if params is None:  # TF's deferred restoration: applied when the optimizer is built
                opt.defer_restore(dict(opt_state), {k: v for k, v in saved.items() if k.startswith(f"{opt.name}/")})
                continue
            saved_state = {v.name: opt_state.get(v.name) for v in params}
            if not opt.per_variable:
                continue  # whole-state variables were restored by name above
            present = {k: v for k, v in saved_state.items() if v}
            if not present:
                logger.warning("checkpoint %s has no optimizer state for %r; its state is unchanged", path, opt.name)
                continue
            opt.restore_per_variable_state(present)
    ckpt.step = data["step"]
    if data.get("save_counter") is not None:  # absent from checkpoints written before it was recorded
        ckpt.save_counter = int(data["save_counter"])
    ckpt.metadata = dict(data.get("metadata") or {})
