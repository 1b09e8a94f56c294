"""``jaxdist.base.files.AtomicFile``: a file appears whole or not at all, and a failure leaves nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jaxdist.base import files
from jaxdist.base.files import AtomicFile

pytestmark = pytest.mark.timeout(60)


def test_binary_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "data.bin"
    target.write_bytes(b"old")
    with AtomicFile(target) as f:
        f.write(b"new ")
        assert target.read_bytes() == b"old", "the target changed before the block ended"
        f.write(b"content")
    assert target.read_bytes() == b"new content"
    assert os.listdir(tmp_path) == ["data.bin"]


def test_text_mode_takes_json_dump(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    with AtomicFile(str(target), text=True) as f:
        json.dump({"b": 1, "a": [1, 2]}, f, sort_keys=True)
    assert json.loads(target.read_text()) == {"a": [1, 2], "b": 1}


def test_a_failure_in_the_block_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "data.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"), AtomicFile(target) as f:
        f.write(b"half of it")
        raise RuntimeError("disk full")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["data.bin"]


def test_a_failed_rename_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()  # os.replace of a file over a directory fails
    with pytest.raises(IsADirectoryError), AtomicFile(target) as f:
        f.write(b"x")
    assert os.listdir(tmp_path) == ["taken"] and target.is_dir()


def test_an_uncreatable_file_raises_from_the_constructor(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        AtomicFile(tmp_path / "missing" / "data.bin")
    assert os.listdir(tmp_path) == []


def test_the_temporary_file_is_beside_the_target_and_named_for_this_process(tmp_path: Path) -> None:
    target = str(tmp_path / "data.bin")
    out = AtomicFile(target)
    with out as f:
        assert out.tmp == files.temporary_name(target) == f"{target}.tmp-{os.getpid()}"
        assert os.path.exists(out.tmp) and not os.path.exists(target)
        f.write(b"x")
    assert not os.path.exists(out.tmp)
