"""Reading a file a user named, with a bound: the one way every command and service reads input
files (spec files, credentials, ``--data @FILE``, workloads, overheads, logs, code bundles).

``Path.read_bytes()`` on a user's path can hang for good or fill memory: a FIFO blocks until a
writer comes, ``/dev/zero`` (or a link to it) never ends, and a procfs file says it is 0 bytes
long whatever it holds (``/proc/kmsg`` then waits for the kernel to log). :func:`read_bounded`
reads only regular files, opened with O_NONBLOCK (a procfs file that would wait gives what it
has), and reads at most ``limit`` bytes (plus one, to know the file is longer), so a wrong path
costs one line, not a hung shell.
"""
from __future__ import annotations

import errno
import os
import stat
from typing import IO, BinaryIO

KiB, MiB, GiB = 2**10, 2**20, 2**30


class FileRefused(OSError):
    """A path that names no regular file, or a file over its limit. An OSError with ``strerror``
    set, so the ``cannot read PATH: {exc.strerror}`` line every caller prints for a missing file
    reads right for these too."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def open_regular(path: str | os.PathLike, mode: str = "r", **kwargs) -> IO:
    """``open(path, mode, **kwargs)`` for reading, of a regular file only (a symbolic link counts
    as what it points to): for reading a file line by line (CSV, JSON lines). Raises
    :class:`FileRefused` for a folder, pipe, socket or device; other OSErrors as ``open`` does."""
    _check_regular(path, os.stat(path))
    # O_NONBLOCK: were the path swapped for a FIFO since the stat, open would wait for a writer
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _check_regular(path, os.fstat(fd))  # what was opened, not what was stat'ed
        return open(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file at ``path`` (see :func:`open_regular`).

    ``limit``: the most bytes accepted. Raises :class:`FileRefused` for a folder, pipe, socket or
    device, and for a file longer than ``limit``; other OSErrors (missing, unreadable) as
    ``open`` raises them. A file whose size says 0 is read all the same (procfs files say 0 and
    hold text); one that would wait for data gives what it has (the file is open with O_NONBLOCK,
    where a read that would block returns None).
    """
    with open_regular(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise FileRefused(errno.EFBIG, f"{size:,} bytes, over the limit of {limit:,}", os.fspath(path))
        data = b""
        while len(data) <= limit and (more := fh.read(limit + 1 - len(data))):
            data += more  # to the end, or one byte past the limit where the file grew since the stat
    if len(data) > limit:
        raise FileRefused(errno.EFBIG, f"over the limit of {limit:,} bytes", os.fspath(path))
    return data


def check_regular(path: str | os.PathLike) -> None:
    """Raise :class:`FileRefused` unless ``path`` is a regular file (or a link to one), for a
    reader that opens the file itself (the ssl module a TLS file); other OSErrors as ``stat``."""
    _check_regular(path, os.stat(path))


def _check_regular(path: str | os.PathLike, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(errno.EINVAL, f"{_kind(st.st_mode)}, not a regular file", os.fspath(path))


def read_stream(stream: BinaryIO, limit: int, what: str) -> bytes:
    """At most ``limit`` bytes of ``stream`` (stdin); raises :class:`FileRefused` naming ``what``
    when it holds more (it is not read on past the limit)."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise FileRefused(errno.EFBIG, f"over the limit of {limit:,} bytes", what)
    return data
