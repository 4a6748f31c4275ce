"""Reading a file a user named (services/common/files.py): only regular files, never past a
limit, never a read that blocks, and an OSError whose strerror reads as one line."""
from __future__ import annotations

import io
import os

import pytest

from dilu.services.common import files


@pytest.mark.timeout(20)
def test_a_pipe_a_device_and_a_folder_are_refused_without_reading(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # open() alone would wait for a writer
    os.symlink("/dev/zero", tmp_path / "zeros")  # endless
    for path, what in ((tmp_path / "fifo", "a named pipe"), (tmp_path / "zeros", "a device"), (tmp_path, "a folder")):
        with pytest.raises(files.FileRefused) as err:
            files.read_bounded(path, 1024)
        assert err.value.strerror == f"{what}, not a regular file" and err.value.filename == str(path)
        with pytest.raises(files.FileRefused):
            files.open_regular(path)


def test_a_file_is_read_up_to_its_limit_and_refused_past_it(tmp_path):
    f = tmp_path / "data"
    f.write_bytes(b"x" * 100)
    assert files.read_bounded(f, 100) == b"x" * 100
    with pytest.raises(files.FileRefused, match="100 bytes, over the limit of 99"):
        files.read_bounded(f, 99)
    f.write_bytes(b"")
    assert files.read_bounded(f, 0) == b""


def test_a_missing_file_is_the_usual_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.read_bounded(tmp_path / "nope", 10)
    with pytest.raises(FileNotFoundError):
        files.open_regular(tmp_path / "nope")


def test_open_regular_gives_a_file_to_read_line_by_line(tmp_path):
    (tmp_path / "t.csv").write_text("a,b\n1,2\n")
    with files.open_regular(tmp_path / "t.csv", newline="") as fh:
        assert fh.read().splitlines() == ["a,b", "1,2"]


def test_a_stream_is_read_no_further_than_one_byte_past_its_limit():
    stream = io.BytesIO(b"y" * 50)
    with pytest.raises(files.FileRefused, match="over the limit of 10 bytes"):
        files.read_stream(stream, 10, "stdin")
    assert stream.tell() == 11
    assert files.read_stream(io.BytesIO(b"ok"), 10, "stdin") == b"ok"


@pytest.mark.timeout(20)
def test_a_procfs_file_is_read_though_it_says_size_0():
    assert os.stat("/proc/self/status").st_size == 0
    assert files.read_bounded("/proc/self/status", 64 * files.KiB).startswith(b"Name:")
