"""Packing a function's code folder (services/common/bundle.py): a deterministic digest, caches
left out, and a clear one-line BundleError, never a hang, for what cannot be bundled."""
from __future__ import annotations

import io
import os
import socket
import zipfile

import pytest

from dilu.services.common.bundle import BundleError, pack


def _names(data: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(data)).namelist()


def test_equal_folders_give_equal_digests_and_caches_are_left_out(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d / "pkg" / "__pycache__").mkdir(parents=True)
        (tmp_path / d / "main.py").write_text("x = 1\n")
        (tmp_path / d / "pkg" / "util.py").write_text("y = 2\n")
        (tmp_path / d / "pkg" / "__pycache__" / "util.cpython-311.pyc").write_bytes(b"\0")
    os.utime(tmp_path / "b" / "main.py", (0, 0))  # timestamps are not part of the digest
    (data_a, key_a), (data_b, key_b) = pack(tmp_path / "a"), pack(tmp_path / "b")
    assert key_a == key_b and key_a.startswith("sha256-")
    assert _names(data_a) == ["main.py", "pkg/util.py"]
    (tmp_path / "b" / "main.py").write_text("x = 2\n")
    assert pack(tmp_path / "b")[1] != key_a


def test_a_named_pipe_is_refused_not_read(tmp_path):
    (tmp_path / "main.py").write_text("x = 1\n")
    os.mkfifo(tmp_path / "fifo")  # reading it would block until a writer came
    with pytest.raises(BundleError, match=r"'fifo' is not a regular file"):
        pack(tmp_path)


def test_a_socket_or_a_link_to_a_device_is_refused(tmp_path):
    (tmp_path / "main.py").write_text("x = 1\n")
    os.symlink("/dev/zero", tmp_path / "zeros")  # endless: read_bytes would never return
    with pytest.raises(BundleError, match=r"'zeros' is not a regular file"):
        pack(tmp_path)
    os.unlink(tmp_path / "zeros")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s.sock"))
        with pytest.raises(BundleError, match=r"'s.sock' is not a regular file"):
            pack(tmp_path)
    finally:
        sock.close()


def test_a_dangling_link_is_named(tmp_path):
    (tmp_path / "main.py").write_text("x = 1\n")
    os.symlink(tmp_path / "gone.py", tmp_path / "link.py")
    with pytest.raises(BundleError, match=r"cannot read 'link.py': No such file"):
        pack(tmp_path)


def test_an_unreadable_file_is_named(tmp_path):
    secret = tmp_path / "secret.py"
    secret.write_text("z = 3\n")
    secret.chmod(0)
    if os.access(secret, os.R_OK):  # root reads anything
        pytest.skip("this user reads files without read permission")
    with pytest.raises(BundleError, match=r"cannot read 'secret.py'"):
        pack(tmp_path)


def test_a_missing_folder_is_one_line(tmp_path):
    with pytest.raises(BundleError, match="does not exist or is not a folder"):
        pack(tmp_path / "nope")
