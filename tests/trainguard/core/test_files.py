"""The one atomic write: a reader sees the old file or the new one, and a failed write leaves nothing."""

from __future__ import annotations

import json
import os

import pytest

from trainguard.core import files


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "a" / "doc.json"
    files.write_json_atomic(target, {"b": 1, "a": [1, 2]}, sort_keys=True)
    assert target.read_text() == '{"a": [1, 2], "b": 1}'
    files.write_json_atomic(target, {"x": 1}, compact=True)
    assert target.read_text() == '{"x":1}'
    files.write_json_atomic(target, {"x": 1}, indent=2)
    assert json.loads(target.read_text()) == {"x": 1} and target.read_text().endswith("}\n")
    assert sorted(p.name for p in target.parent.iterdir()) == ["doc.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "doc"
    files.write_atomic(target, b"old")

    def fail(_src, _dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        files.write_atomic(target, b"new", fsync=True)
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["doc"]


def test_a_missing_folder_is_not_made_when_told_not_to_and_a_spool_writes_through_its_own_tmp(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.write_atomic(tmp_path / "gone" / "committed.json", "{}", make_parent=False)
    assert not (tmp_path / "gone").exists()
    spool, tmp = tmp_path / "alerts", tmp_path / ".tmp"
    spool.mkdir()
    tmp.mkdir()
    files.write_atomic(spool / "a1.json", b"{}", tmp_dir=tmp, make_parent=False)
    assert [p.name for p in spool.iterdir()] == ["a1.json"] and list(tmp.iterdir()) == []
