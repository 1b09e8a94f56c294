"""Incremental exports for serving: a full export, then only what changed, readable with numpy alone.

An online serving store follows training by loading one full export of the parameter servers'
variables and then applying, export after export, the *deltas*: the dense weights whole, and per
embedding table only the rows changed since the previous export (and, for keyed tables, the keys
evicted since). :class:`IncrementalExporter` writes them under ``ParameterServerStrategy``;
:func:`load_latest`, :func:`load_export` and :func:`apply_delta` read them back (numpy and the
standard library only: a serving process needs nothing else to do the same).

A directory of exports::

    exports/
      00000001-full/         sequence 1: every variable whole
        manifest.json        written last (the format, sequence, base, previous, files + sha256, layout)
        ps-0.npz, ps-1.npz   one numpy archive per PS task, written by that PS
      00000002-delta/        sequence 2: what changed since 1
      00000003-delta/        sequence 3: what changed since 2
      00000004-full/         a new chain (a PS restarted, the variables changed, or asked for)

**Atomic.** An export is written to ``<name>.tmp-<id>/`` (each PS writes, fsyncs and renames its
own file), the manifest last, then the directory is renamed into place and the parent directory
fsynced. A reader sees a whole export or none; :func:`list_exports` skips ``.tmp-`` directories.

**Exact.** Each PS cuts its change tracking under every variable lock
(:mod:`jaxdist.ps_server.export_rows`): a push is in exactly one export. Applying deltas 2..n to
full export 1 gives, bit for bit, what a full export at n would hold. With ``pause=True`` (the
default) the coordinator hands out no closure while the PS tasks cut (a quiet point, as a
checkpoint's), so no closure's pushes to several PS tasks straddle an export either.

**Never silently incomplete.** A delta names the cut of the previous export on every PS; a PS that
cannot answer it (restarted, replaced by its promoted backup, or its state replaced) says so, and
the exporter writes a full export instead (``kind == "full"``, ``reason`` says why). The same when
the variables or their sharding changed since the previous export. An export that fails publishes
nothing, and the next one is again relative to the last published export.

The files: per variable and shard, ``value/<shard>`` (whole) or ``ids/<shard>`` (int64 global row
numbers, ascending) with ``rows/<shard>`` (the rows); per keyed (dynamic) table and shard
``keys/<table>`` (int64 or numpy unicode), ``rows/<table>`` and, in a delta, ``evicted/<table>``. A
dynamic table created, restored or replaced since the previous export makes the next one full. The manifest maps every variable to its
shards (file, array keys, first row) so a reader needs no naming rule.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
import zipfile
import zlib
from collections import defaultdict
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxdist.base.errors import ConfigurationError, JaxdistError
from jaxdist.base.files import AtomicFile
from jaxdist.proto import ps_pb2
from jaxdist.ps_server import export_rows
from jaxdist.ps_server.client import PSClient

if TYPE_CHECKING:
    from jaxdist.cluster_coordinator.coordinator import ClusterCoordinator
    from jaxdist.strategy import ParameterServerStrategy

logger = logging.getLogger(__name__)

__all__ = [
    "ExportChainError", "ExportError", "ExportFormatError", "ExportInfo", "ExportState", "IncrementalExporter",
    "KeyedRows", "apply_delta", "list_exports", "load_export", "load_latest",
]

#: The ``"format"`` of an export's manifest.
FORMAT = "jaxdist.serving_export/1"
MANIFEST = "manifest.json"
_NAME_RE = re.compile(r"^(\d{8})-(full|delta)$")
_PLAIN_FILE_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class ExportError(JaxdistError, ValueError):
    """An export cannot be read or applied."""


class ExportFormatError(ExportError):
    """An export is malformed: no or a bad manifest, a missing or corrupt file (sha256), arrays that
    do not match the manifest (shape, dtype, row ids out of range, unsorted or repeated)."""


class ExportChainError(ExportError):
    """A delta does not apply to the state it is given: another chain (full export), not the next in
    sequence, a full export given as a delta, or variables whose shapes or dtypes differ."""


# ------------------------------------------------------------------ reading
@dataclass
class KeyedRows:
    """A keyed (dynamic) table as an export gives it: ``keys`` ascending (int64, or numpy strings)
    and ``values[i]`` the row of ``keys[i]``."""

    keys: np.ndarray
    values: np.ndarray


@dataclass
class ExportState:
    """The variables as of export :attr:`sequence` (a full export with the deltas up to it applied)."""

    name: str
    sequence: int
    chain: str
    variables: dict[str, np.ndarray]
    tables: dict[str, KeyedRows] = field(default_factory=dict)
    step: int | None = None


@dataclass
class ExportInfo:
    """One published export: its directory, and what its manifest says."""

    path: str
    name: str
    sequence: int
    kind: str  # "full" or "delta"
    chain: str
    base: str  # the full export the chain starts at (its own name for a full export)
    previous: str | None  # the export a delta applies on top of
    reason: str  # why a full export is full ("first", "asked", "every", "layout", "ps:<i> ...")
    changed_rows: dict[str, int]  # per variable: rows in the file (its row count when whole)
    bytes: int


def _manifest(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise ExportFormatError(f"{path} is not a published export (no {MANIFEST})") from None
    except (OSError, ValueError) as e:
        raise ExportFormatError(f"{path}/{MANIFEST} cannot be read: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ExportFormatError(f"{path}: not a {FORMAT} export (format {m.get('format') if isinstance(m, dict) else m!r})")
    for key, kind in (("kind", str), ("sequence", int), ("chain", str), ("base", str), ("files", dict),
                      ("variables", dict), ("tables", dict)):
        if not isinstance(m.get(key), kind):
            raise ExportFormatError(f"{path}/{MANIFEST}: field {key!r} missing or not a {kind.__name__}")
    if m["kind"] not in ("full", "delta"):
        raise ExportFormatError(f"{path}/{MANIFEST}: kind {m['kind']!r}")
    return m


def _info(path: str, m: dict[str, Any]) -> ExportInfo:
    changed = {name: sum(int(s.get("rows", 0)) for s in v.get("shards", [])) for name, v in m["variables"].items()}
    return ExportInfo(path=path, name=os.path.basename(path), sequence=m["sequence"], kind=m["kind"], chain=m["chain"],
                      base=m["base"], previous=m.get("previous"), reason=m.get("reason", ""), changed_rows=changed,
                      bytes=sum(int(f.get("bytes", 0)) for f in m["files"].values()))


def list_exports(directory: str) -> list[ExportInfo]:
    """The published exports in ``directory``, by sequence (in-progress ``.tmp-`` ones skipped)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if not _NAME_RE.match(n) or not os.path.isfile(os.path.join(directory, n, MANIFEST)):
            continue
        path = os.path.join(directory, n)
        out.append(_info(path, _manifest(path)))
    return sorted(out, key=lambda i: i.sequence)


def _np_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and the float8 types (installed with jax)

        return np.dtype(getattr(ml_dtypes, name))


class _Files:
    """The archives of one export, each checked against its sha256 before it is opened."""

    def __init__(self, path: str, files: Mapping[str, Any]) -> None:
        self.path, self.files = path, files
        self._open: dict[str, Any] = {}
        self._fhs: list[Any] = []

    def array(self, file: Any, key: Any) -> np.ndarray:
        if not isinstance(file, str) or file not in self.files or not _PLAIN_FILE_RE.match(file):
            raise ExportFormatError(f"{self.path}: the manifest names file {file!r}, which it does not list")
        if file not in self._open:
            full = os.path.join(self.path, file)
            h = hashlib.sha256()
            try:
                with open(full, "rb") as f:
                    while block := f.read(8 << 20):
                        h.update(block)
            except OSError as e:
                raise ExportFormatError(f"{full} cannot be read: {e.strerror}") from None
            if h.hexdigest() != self.files[file].get("sha256"):
                raise ExportFormatError(f"{full} is corrupt (sha256 mismatch)")
            try:
                fh = open(full, "rb")  # ours, so closed when a truncated file makes np.load fail
            except OSError as e:
                raise ExportFormatError(f"{full} cannot be read: {e.strerror}") from None
            try:
                self._open[file] = np.load(fh, allow_pickle=False)
                self._fhs.append(fh)
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # truncated: BadZipFile
                fh.close()
                raise ExportFormatError(f"{full} is not a numpy archive: {e}") from None
        try:
            return np.asarray(self._open[file][key])
        except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise ExportFormatError(f"{self.path}/{file} has no array {key!r} ({e})") from None

    def close(self) -> None:
        for a in self._open.values():
            a.close()
        for fh in self._fhs:
            fh.close()


def _check(cond: bool, path: str, what: str) -> None:
    if not cond:
        raise ExportFormatError(f"{path}: {what}")


def _shards(path: str, name: str, v: Any) -> tuple[tuple[int, ...], np.dtype, list[dict[str, Any]]]:
    _check(isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("shards"), list)
           and isinstance(v.get("dtype"), str), path, f"variable {name!r} is malformed in the manifest")
    shape = tuple(int(d) for d in v["shape"])
    try:
        dtype = _np_dtype(v["dtype"])
    except (TypeError, AttributeError, ImportError):
        raise ExportFormatError(f"{path}: variable {name!r} has unknown dtype {v['dtype']!r}") from None
    return shape, dtype, v["shards"]


def _read_value(files: _Files, path: str, name: str, shape: tuple[int, ...], dtype: np.dtype, s: dict[str, Any]) -> np.ndarray:
    a = files.array(s.get("file"), s.get("value"))
    want = (int(s.get("rows", 0)),) + shape[1:] if shape else ()
    _check(a.shape == want, path, f"{name!r}: shard {s.get('name')!r} has shape {a.shape}, the manifest says {want}")
    return a.view(dtype) if a.dtype != dtype and a.dtype.itemsize == dtype.itemsize and a.dtype.kind == "V" else a


def _typed(fn: Any) -> Any:
    """``fn`` with a manifest's wrong types or missing fields (KeyError, TypeError, ...) raised as ExportFormatError."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ExportError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            raise ExportFormatError(f"{args[-1]}: malformed export ({type(e).__name__}: {e})") from None

    return wrapper


@_typed
def load_export(path: str) -> ExportState:
    """Read a full export (every variable whole, every keyed table's rows), checking every file.

    Raises:
        ExportFormatError: not a published export, a corrupt or missing file, arrays that do not match.
        ExportChainError: ``path`` is a delta (give its chain's full export, then :func:`apply_delta`).
    """
    m = _manifest(path)
    if m["kind"] != "full":
        raise ExportChainError(f"{path} is a delta export; load its full export {m['base']!r} and apply the deltas")
    files = _Files(path, m["files"])
    try:
        variables = {}
        for name, v in m["variables"].items():
            shape, dtype, shards = _shards(path, name, v)
            parts, row = [], 0
            for s in shards:
                _check(isinstance(s, dict) and s.get("whole") is True and int(s.get("row_start", -1)) == row, path,
                       f"{name!r}: a full export's shards are whole and tile the rows in order")
                parts.append(_read_value(files, path, name, shape, dtype, s))
                row += int(s["rows"])
            value = parts[0] if len(parts) == 1 and not shape else np.concatenate(parts, axis=0) if shape else parts[0]
            _check(value.shape == shape and value.dtype == dtype, path, f"{name!r} assembles to {value.shape} {value.dtype}")
            variables[name] = value
        tables = {}
        for name, t in m["tables"].items():
            keys, values = _read_keyed(files, path, name, t, with_evicted=False)[:2]
            tables[name] = _sorted_rows(keys, values)
    finally:
        files.close()
    return ExportState(name=os.path.basename(os.path.normpath(path)), sequence=m["sequence"], chain=m["chain"],
                       variables=variables, tables=tables, step=m.get("step"))


def _read_keyed(files: _Files, path: str, name: str, t: Any, with_evicted: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    _check(isinstance(t, dict) and isinstance(t.get("shards"), list) and t["shards"], path,
           f"table {name!r} is malformed in the manifest")
    keys: list[np.ndarray] = []
    values: list[np.ndarray] = []
    evicted: list[np.ndarray] = []
    for s in t["shards"]:
        _check(isinstance(s, dict), path, f"table {name!r}: a shard is malformed")
        k = files.array(s.get("file"), s.get("keys"))
        v = files.array(s.get("file"), s.get("values"))
        _check(k.ndim == 1 and k.dtype.kind in "iuU" and v.ndim >= 1 and len(v) == len(k), path,
               f"table {name!r}: keys {k.dtype}{list(k.shape)} and rows {list(v.shape)} do not match")
        _check(not values or (v.shape[1:] == values[0].shape[1:] and v.dtype == values[0].dtype), path,
               f"table {name!r}: shards hold rows of different shapes or dtypes")
        keys.append(k)
        values.append(v)
        if with_evicted:
            e = files.array(s.get("file"), s.get("evicted"))
            _check(e.ndim == 1 and e.dtype.kind in "iuU", path, f"table {name!r}: evicted keys are {e.dtype}{list(e.shape)}")
            evicted.append(e)
    cat_k = np.concatenate(keys)
    cat_e = np.concatenate(evicted) if evicted else cat_k[:0]
    return cat_k, np.concatenate(values), cat_e


def _sorted_rows(keys: np.ndarray, values: np.ndarray) -> KeyedRows:
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    if len(keys) > 1 and (keys[1:] == keys[:-1]).any():
        raise ExportFormatError("a keyed table holds a key twice")
    return KeyedRows(keys, values[order])


def _keys_like(keys: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``keys`` (of the same kind as ``like``, checked) in ``like``'s integer dtype; strings keep their
    own width (a cast to ``like``'s unicode width would cut longer keys short)."""
    if not len(keys):
        return like[:0]
    return keys if like.dtype.kind == "U" else keys.astype(like.dtype, copy=False)


@_typed
def apply_delta(state: ExportState, path: str) -> ExportState:
    """Apply the delta export at ``path`` to ``state`` (in place; also returned).

    Everything is read and checked before ``state`` changes: a delta that does not apply leaves it.

    Raises:
        ExportChainError: ``path`` is a full export, of another chain, or not the export after
            ``state`` (its ``previous`` is not ``state``); a variable's shape or dtype differs.
        ExportFormatError: malformed or corrupt (sha256, shapes, dtypes, row ids out of range,
            unsorted or repeated).
    """
    m = _manifest(path)
    if m["kind"] != "delta":
        raise ExportChainError(f"{path} is a full export, not a delta (load it with load_export)")
    if m["chain"] != state.chain:
        raise ExportChainError(f"{path} belongs to chain {m['chain']} (full export {m['base']!r}), the state to {state.chain}")
    if m.get("previous_sequence") != state.sequence or m.get("previous") != state.name:
        raise ExportChainError(f"{path} applies to export {m.get('previous')!r} (sequence {m.get('previous_sequence')}); "
                               f"the state is {state.name!r} (sequence {state.sequence}): apply the deltas in order")
    if set(m["variables"]) != set(state.variables) or set(m["tables"]) != set(state.tables):
        raise ExportChainError(f"{path} holds other variables or tables than the state")
    files = _Files(path, m["files"])
    staged: list[tuple[str, Any, np.ndarray]] = []  # (variable, row ids or None for whole, values)
    table_updates: dict[str, KeyedRows] = {}
    try:
        for name, v in m["variables"].items():
            shape, dtype, shards = _shards(path, name, v)
            cur = state.variables[name]
            if shape != cur.shape or dtype != cur.dtype:
                raise ExportChainError(f"{path}: {name!r} is {shape} {dtype} there, {cur.shape} {cur.dtype} in the state")
            for s in shards:
                _check(isinstance(s, dict) and isinstance(s.get("whole"), bool), path, f"{name!r}: a shard is malformed")
                start, rows = int(s.get("row_start", -1)), int(s.get("rows", -1))
                if s["whole"]:
                    a = _read_value(files, path, name, shape, dtype, s)
                    if not shape:
                        staged.append((name, None, a))
                        continue
                    _check(0 <= start and start + len(a) <= shape[0], path, f"{name!r}: shard rows out of range")
                    staged.append((name, np.arange(start, start + len(a)), a))
                    continue
                _check(bool(shape), path, f"{name!r} is a scalar: it has no rows")
                ids = files.array(s.get("file"), s.get("ids"))
                vals = files.array(s.get("file"), s.get("values"))
                if vals.dtype != dtype and vals.dtype.kind == "V" and vals.dtype.itemsize == dtype.itemsize:
                    vals = vals.view(dtype)
                _check(ids.ndim == 1 and ids.dtype.kind in "iu" and len(ids) == rows, path,
                       f"{name!r}: row ids {ids.dtype}{list(ids.shape)}, the manifest says {rows}")
                _check(vals.shape == (len(ids),) + shape[1:] and vals.dtype == dtype, path,
                       f"{name!r}: rows {vals.dtype}{list(vals.shape)} for {len(ids)} ids of a {dtype}{list(shape)}")
                _check(not len(ids) or (ids[0] >= max(start, 0) and ids[-1] < min(start + int(s.get("shard_rows", 0)), shape[0])),
                       path, f"{name!r}: row ids outside the shard's rows")
                _check(len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()), path, f"{name!r}: row ids unsorted or repeated")
                staged.append((name, ids.astype(np.int64), vals))
        for name, t in m["tables"].items():
            keys, values, evicted = _read_keyed(files, path, name, t, with_evicted=True)
            cur_t = state.tables[name]
            _check(values.shape[1:] == cur_t.values.shape[1:] and values.dtype == cur_t.values.dtype, path,
                   f"table {name!r}: rows {values.dtype}{list(values.shape[1:])}, the state's {cur_t.values.dtype}"
                   f"{list(cur_t.values.shape[1:])}")
            for what, a in (("keys", keys), ("evicted keys", evicted)):
                _check(not len(a) or not len(cur_t.keys) or (a.dtype.kind == "U") == (cur_t.keys.dtype.kind == "U"), path,
                       f"table {name!r}: {what} are {a.dtype}, the state's keys {cur_t.keys.dtype}")
            _check(not len(keys) or not len(evicted) or (keys.dtype.kind == "U") == (evicted.dtype.kind == "U"), path,
                   f"table {name!r}: keys are {keys.dtype}, evicted keys {evicted.dtype}")
            upd = _sorted_rows(keys, values)
            if len(cur_t.keys):
                new_keys = _keys_like(upd.keys, cur_t.keys)
                gone = np.isin(cur_t.keys, np.concatenate([new_keys, _keys_like(evicted, cur_t.keys)]))
                table_updates[name] = _sorted_rows(np.concatenate([cur_t.keys[~gone], new_keys]),
                                                   np.concatenate([cur_t.values[~gone], upd.values]))
            else:
                table_updates[name] = upd
    finally:
        files.close()
    # Checked and read: now change the state.
    for name, ids, vals in staged:
        if ids is None:
            state.variables[name] = np.array(vals, copy=True)
        else:
            state.variables[name][ids] = vals
    state.tables.update(table_updates)
    state.name, state.sequence, state.step = os.path.basename(os.path.normpath(path)), m["sequence"], m.get("step")
    return state


def load_latest(directory: str) -> ExportState:
    """The newest state ``directory`` holds: its latest full export with every later delta of its chain applied.

    Raises:
        ExportFormatError: no published full export there, or a malformed one.
        ExportChainError: the deltas after it do not form its chain (one missing).
    """
    exports = list_exports(directory)
    fulls = [e for e in exports if e.kind == "full"]
    if not fulls:
        raise ExportFormatError(f"{directory} holds no published full export")
    state = load_export(fulls[-1].path)
    for e in exports:
        if e.sequence > state.sequence:
            if e.kind != "delta" or e.chain != state.chain:
                break
            apply_delta(state, e.path)
    return state


# ---------------------------------------------------------------- writing
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _export_on(req: ps_pb2.ExportRequest, client: PSClient) -> ps_pb2.ExportResponse:
    return client.export(req)


class IncrementalExporter:
    """Writes full and delta exports of a ``ParameterServerStrategy``'s variables into ``directory``.

    Args:
        strategy: the strategy whose variables (all of them) are exported, with every dynamic
            table its PS tasks hold (:class:`~jaxdist.DynamicEmbedding`: keys, rows, evicted keys).
        directory: where the exports go (made if missing; every PS task must be able to write
            there, as for checkpoints). Exports already there are continued: the next export is a
            delta relative to the newest one when every PS can still answer it.
        pause: hand out no closure while the PS tasks cut (a quiet point; closures running finish
            first). False: each PS cuts atomically on its own; a closure that pushes to several
            PS tasks may have some of its pushes in one export and the rest in the next.
        full_every: write a full export every this many exports (None: only when needed).
        coordinator: the ClusterCoordinator to pause (default: the strategy's).
    """

    def __init__(self, strategy: ParameterServerStrategy, directory: str, *, pause: bool = True,
                 full_every: int | None = None, coordinator: ClusterCoordinator | None = None) -> None:
        if full_every is not None and full_every < 1:
            raise ValueError(f"full_every must be >= 1 or None, got {full_every}")
        self.strategy = strategy
        self.directory = os.path.abspath(directory)
        self.pause = pause
        self.full_every = full_every
        self._coordinator = coordinator
        os.makedirs(self.directory, exist_ok=True)
        for n in os.listdir(self.directory):  # exports a crash left unpublished
            if ".tmp-" in n:
                shutil.rmtree(os.path.join(self.directory, n), ignore_errors=True)
        exports = list_exports(self.directory)
        self._last: dict[str, Any] | None = _manifest(exports[-1].path) if exports else None
        self.last: ExportInfo | None = exports[-1] if exports else None

    def _layout(self) -> dict[str, Any]:
        out = {}
        for name, var in self.strategy.variables.items():
            out[name] = {"shape": list(var.shape), "dtype": _dtype_name(var.dtype),
                         "shards": [[shard.name, shard.ps_index, row, list(shard.shape)] for shard, row in var.shards()]}
        return out

    def export(self, *, full: bool = False, step: int | None = None, metadata: Mapping[str, Any] | None = None) -> ExportInfo:
        """Write the next export and publish it; returns what was written.

        A delta unless ``full``, or there is no earlier export, or ``full_every`` says so, or the
        variables or their sharding changed, or a PS cannot answer a delta (it restarted or its
        backup took over since the previous export): then a full export, whose
        :attr:`ExportInfo.reason` says why.

        Raises:
            PSUnavailableError: a PS cannot be reached (nothing is published; the next export is
                relative to the last published one, as this one would have been).
            InvalidRequestError: a PS cannot write into the directory.
        """
        layout = self._layout()
        prev = self._last
        reason = ""
        if full:
            reason = "asked"
        elif prev is None:
            reason = "first"
        elif prev.get("layout") != layout:
            reason = "layout: the variables or their sharding changed"
        elif self.full_every is not None and prev["sequence"] - _sequence_of(prev["base"]) + 1 >= self.full_every:
            reason = f"every {self.full_every} exports"
        sequence = 1 if prev is None else prev["sequence"] + 1
        coordinator = self._coordinator if self._coordinator is not None else self.strategy.coordinator
        t0 = time.perf_counter()
        with coordinator.paused() if (self.pause and coordinator is not None) else nullcontext():
            written: tuple[str, dict[int, ps_pb2.ExportResponse]] | str = ""
            if not reason:
                written = self._write(sequence, layout, prev, delta=True)
                if isinstance(written, str):
                    reason = written
            if reason:
                written = self._write(sequence, layout, prev, delta=False)
        if isinstance(written, str):  # pragma: no cover - a full export always writes (or raises)
            raise AssertionError("a full export was refused")
        tmp, results = written
        name = f"{sequence:08d}-{'full' if reason else 'delta'}"
        manifest = self._manifest(name, sequence, reason, layout, prev, results, step, metadata)
        try:
            with AtomicFile(os.path.join(tmp, MANIFEST), text=True) as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
            _fsync_dir(tmp)  # the files' names in it durable before it is published
            final = os.path.join(self.directory, name)
            if os.path.exists(final):
                raise FileExistsError(f"export {final} already exists (another exporter writes into {self.directory})")
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._last = manifest  # published: the next export follows it
        self.last = _info(final, manifest)
        _fsync_dir(self.directory)  # the rename made durable
        logger.info("export %s (%s%s): %.1f MB in %.2fs", name, manifest["kind"], f", {reason}" if reason else "",
                    self.last.bytes / 2**20, time.perf_counter() - t0)
        return self.last

    def _write(self, sequence: int, layout: dict[str, Any], prev: dict[str, Any] | None,
               delta: bool) -> tuple[str, dict[int, ps_pb2.ExportResponse]] | str:
        """Every PS writes its file into a new temporary directory: ``(directory, answers)``; for a
        delta that some PS cannot answer, the reason instead (the directory is removed)."""
        tmp = os.path.join(self.directory, f"{sequence:08d}.tmp-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        conns = self.strategy.connections
        by_ps: dict[int, ps_pb2.ExportRequest] = defaultdict(ps_pb2.ExportRequest)
        for i in range(len(conns.clients)):
            req = by_ps[i]
            req.directory, req.file_name, req.delta = tmp, f"ps-{i}.npz", delta
            if prev is not None and i < len(prev["ps"]):
                req.base_generation, req.base_cut = prev["ps"][i]["generation"], int(prev["ps"][i]["cut"])
        for v in layout.values():
            for shard_name, ps_index, row, _ in v["shards"]:
                by_ps[ps_index].variables.add(name=shard_name, row_offset=row)
        try:
            results = conns.fan_out({i: functools.partial(_export_on, req) for i, req in by_ps.items()})
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        missing = [i for i, r in sorted(results.items()) if r.delta_unavailable]
        whole = sorted({t for r in results.values() for t in r.whole_tables})
        if missing or whole:
            shutil.rmtree(tmp, ignore_errors=True)
            if missing:
                why = (f"ps:{missing[0]} cannot answer a delta relative to the previous export (it restarted, its "
                       "backup took over, or its state was replaced since)")
            else:  # a keyed table new or replaced since: a delta cannot say which keys it lost
                why = f"keyed table {whole[0]!r} changed as a whole"
            logger.warning("export %d: %s; writing a full export", sequence, why)
            return why
        return tmp, results

    def _manifest(self, name: str, sequence: int, reason: str, layout: dict[str, Any], prev: dict[str, Any] | None,
                  results: dict[int, ps_pb2.ExportResponse], step: int | None,
                  metadata: Mapping[str, Any] | None) -> dict[str, Any]:
        answered = {(i, ev.name): ev for i, r in results.items() for ev in r.variables}
        variables: dict[str, Any] = {}
        for vname, v in layout.items():
            shards = []
            for shard_name, ps_index, row, shard_shape in v["shards"]:
                ev = answered.get((ps_index, shard_name))
                if ev is None:
                    raise ConfigurationError(f"ps:{ps_index} did not export {shard_name!r}")
                file = f"ps-{ps_index}.npz"
                s: dict[str, Any] = {"name": shard_name, "file": file, "row_start": row, "whole": ev.whole,
                                     "rows": int(ev.rows), "shard_rows": shard_shape[0] if shard_shape else 1}
                if ev.whole:
                    s["value"] = export_rows.value_key(shard_name)
                else:
                    s["ids"], s["values"] = export_rows.ids_key(shard_name), export_rows.rows_key(shard_name)
                shards.append(s)
            variables[vname] = {"shape": v["shape"], "dtype": v["dtype"], "shards": shards}
        tables: dict[str, Any] = {}
        for i, r in sorted(results.items()):
            for t in r.tables:
                tables.setdefault(t, {"shards": []})["shards"].append(
                    {"file": f"ps-{i}.npz", "keys": export_rows.keys_key(t), "values": export_rows.rows_key(t),
                     "evicted": export_rows.evicted_key(t)})
        chain = uuid.uuid4().hex if reason or prev is None else prev["chain"]
        return {
            "format": FORMAT,
            "name": name,
            "kind": "full" if reason else "delta",
            "reason": reason,
            "sequence": sequence,
            "chain": chain,
            "base": name if reason else prev["base"],  # type: ignore[index]
            "previous": None if reason else prev["name"],  # type: ignore[index]
            "previous_sequence": None if reason else prev["sequence"],  # type: ignore[index]
            "step": step,
            "created": time.time(),
            "metadata": dict(metadata or {}),
            "ps": [{"generation": results[i].generation, "cut": int(results[i].cut)} for i in sorted(results)],
            "files": {r.file_name: {"sha256": r.sha256, "bytes": int(r.bytes)} for r in results.values()},
            "variables": variables,
            "tables": tables,
            "layout": layout,
        }


def _sequence_of(name: str) -> int:
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else 0


def _dtype_name(dt: np.dtype) -> str:
    return dt.name if dt.kind == "V" or dt.name == "bfloat16" else dt.str
