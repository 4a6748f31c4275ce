"""Packing a function's code folder (services/common/bundle.py): a deterministic digest, caches
left out, and a clear one-line BundleError, never a hang, for what cannot be bundled."""
from __future__ import annotations

import io
import os
import socket
import zipfile
from pathlib import Path

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


def test_a_linked_folder_is_bundled_and_a_link_loop_refused(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "util.py").write_text("y = 2\n")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "main.py").write_text("x = 1\n")
    os.symlink(tmp_path / "lib", tmp_path / "code" / "lib")  # left out without followlinks
    assert _names(pack(tmp_path / "code")[0]) == ["lib/util.py", "main.py"]
    os.symlink(tmp_path / "code", tmp_path / "lib" / "back")  # code/lib/back is code again
    with pytest.raises(BundleError, match=r"'lib/back' links to a folder that holds it"):
        pack(tmp_path / "code")


def test_an_unreadable_subfolder_is_named_not_left_out(tmp_path):
    (tmp_path / "main.py").write_text("x = 1\n")
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "model.py").write_text("z = 3\n")
    (tmp_path / "private").chmod(0)
    try:
        if os.access(tmp_path / "private", os.R_OK):  # root lists anything
            pytest.skip("this user lists folders without read permission")
        with pytest.raises(BundleError, match=r"cannot read 'private'"):
            pack(tmp_path)
    finally:
        (tmp_path / "private").chmod(0o755)


def test_a_name_that_is_not_utf8_is_refused_by_name(tmp_path):
    (tmp_path / "main.py").write_text("x = 1\n")
    try:
        (Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9.py"))).write_text("y = 2\n")
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    with pytest.raises(BundleError, match=r"is not UTF-8; rename it"):
        pack(tmp_path)


@pytest.mark.timeout(20)
def test_a_procfs_file_that_says_size_0_is_bundled_with_what_it_holds(tmp_path):
    """A procfs file says it is 0 bytes long whatever it holds; it is read (without waiting)."""
    (tmp_path / "main.py").write_text("x = 1\n")
    os.symlink("/proc/self/status", tmp_path / "status")
    data, _ = pack(tmp_path)
    assert zipfile.ZipFile(io.BytesIO(data)).read("status").startswith(b"Name:")
