"""Append_line: one whole JSON line per write, or the file as it was."""

from __future__ import annotations

import errno
import json
import os

import pytest

from gpumemd import files
from gpumemd.files import append_line


def test_lines_are_appended_whole(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "f.jsonl")
    append_line(path, json.dumps({"a": 1}))
    append_line(path, json.dumps({"b": 2}) + "\n")
    with open(path, encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == [{"a": 1}, {"b": 2}]


@pytest.mark.parametrize("failure", ["short write", "ENOSPC after a partial write"])
def test_a_failed_write_leaves_the_file_as_it_was(tmp_path, monkeypatch, failure: str) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "f.jsonl")
    append_line(path, json.dumps({"kept": True}))
    real_write = os.write

    def half_write(fd: int, data: bytes) -> int:
        n = real_write(fd, data[: len(data) // 2])  # what a full disk does: part of the line lands
        if failure == "short write":
            return n
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "write", half_write)
    with pytest.raises(OSError):
        append_line(path, json.dumps({"lost": "x" * 100}))
    monkeypatch.setattr(files.os, "write", real_write)
    append_line(path, json.dumps({"next": 2}))  # the next record is not glued to a fragment
    with open(path, encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == [{"kept": True}, {"next": 2}]
