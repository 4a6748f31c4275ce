"""Function code bundles: a folder of the user's code, zipped, kept in the JetStream object
store ``dilu-code`` under its content digest, and unpacked on the nodes that run it.

``dilu deploy`` packs the spec's ``code`` folder (:func:`pack`) and stores it (:func:`upload`);
an instance fetches the bundle named by ``FunctionSpec.code`` and unpacks it once per digest
into a cache folder (:func:`fetch`), then imports the entry from there. Equal code gives an
equal digest, so a redeploy of unchanged code stores nothing new.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig
from nats.js.errors import NotFoundError, ObjectNotFoundError

from dilu.contracts import subjects

from . import files
from .jsresources import ensure_object_store

MAX_BUNDLE_BYTES = 64 * 2**20  # a function's code, not its weights: weights load at run time
SKIP_DIRS = {"__pycache__", ".git", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache"}
SKIP_SUFFIXES = (".pyc", ".pyo")
# the fixed timestamp of every entry: the digest depends on names and contents only
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


class BundleError(ValueError):
    """A code folder that cannot be bundled, or a bundle that cannot be fetched; one line."""


def pack(folder: str | os.PathLike) -> tuple[bytes, str]:
    """Zip ``folder`` (files sorted by path, fixed timestamps, caches and VCS folders left out;
    symbolic links count as what they point to); returns ``(zip bytes, key)`` with key
    ``sha256-<hex of the zip>``.

    Raises BundleError when the folder is missing; when it holds a file that is not a regular
    file (a pipe, socket or device: reading one would block or never end), a file or folder that
    cannot be read, a name that is not UTF-8 or a link to a folder that holds it (a loop); or when
    the bundle exceeds ``MAX_BUNDLE_BYTES``. Nothing is left out silently.
    """
    root = Path(folder)
    if not root.is_dir():
        raise BundleError(f"code folder {str(root)!r} does not exist or is not a folder")
    found, total = [], 0
    for f in _walk(root):
        found.append(f)
        total += _regular_size(root, f)
        if total > MAX_BUNDLE_BYTES:  # said as soon as it is known: a folder such as / is not walked whole
            raise BundleError(f"code folder {str(root)!r} holds over {MAX_BUNDLE_BYTES} bytes, the limit "
                              "(load weights at run time instead of shipping them)")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(found):
            name = f.relative_to(root).as_posix()
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.external_attr = 0o644 << 16
            try:
                content = files.read_bounded(f, MAX_BUNDLE_BYTES)  # a file swapped or grown since the walk
            except OSError as exc:
                raise BundleError(f"code folder {str(root)!r}: cannot read {name!r}: {exc.strerror or exc}") from None
            zf.writestr(info, content, compress_type=zipfile.ZIP_DEFLATED)
    data = buf.getvalue()
    return data, "sha256-" + hashlib.sha256(data).hexdigest()


def _walk(root: Path) -> Iterator[Path]:
    """The files under ``root`` to bundle, folder by folder (links to folders followed). Raises
    BundleError for a folder it cannot list, a name that is not UTF-8 and a link loop."""

    def refuse(exc: OSError) -> None:
        raise BundleError(f"code folder {str(root)!r}: cannot read {_rel(root, exc.filename)!r}: "
                          f"{exc.strerror or exc}")

    chains = {str(root): (os.path.realpath(root),)}  # each folder: the real folders from root down to it
    for dirpath, dirnames, filenames in os.walk(root, onerror=refuse, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        kept = sorted(name for name in filenames if not name.endswith(SKIP_SUFFIXES))
        for name in (*dirnames, *kept):
            _check_name(root, Path(dirpath, name))
        chain = chains.pop(dirpath)
        for d in dirnames:
            target = os.path.realpath(os.path.join(dirpath, d))
            if target in chain:
                raise BundleError(f"code folder {str(root)!r}: {_rel(root, Path(dirpath, d))!r} links to a folder "
                                  "that holds it (a loop); remove the link")
            chains[os.path.join(dirpath, d)] = (*chain, target)
        yield from (Path(dirpath) / name for name in kept)


def _rel(root: Path, path: str | os.PathLike | None) -> str:
    try:
        return Path(path or root).relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _check_name(root: Path, path: Path) -> None:
    name = _rel(root, path)
    try:
        name.encode()
    except UnicodeEncodeError:  # undecodable bytes of the name, held as surrogates: zip names are UTF-8
        raise BundleError(f"code folder {str(root)!r}: the name {name!r} is not UTF-8; rename it") from None


def _regular_size(root: Path, f: Path) -> int:
    """The size (bytes) of ``f``, a file under ``root`` to bundle (a symbolic link counts as what it
    points to). Raises BundleError for anything but a regular file and for a file it cannot stat."""
    name = f.relative_to(root).as_posix()
    try:
        st = f.stat()
    except OSError as exc:
        raise BundleError(f"code folder {str(root)!r}: cannot read {name!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise BundleError(f"code folder {str(root)!r}: {name!r} is not a regular file (a pipe, socket or "
                          "device); remove it from the folder")
    return st.st_size


CODE_STORE_CONFIG = ObjectStoreConfig(bucket=subjects.CODE_BUCKET, description="Dilu function code")


async def _store(js: JetStreamContext, *, create: bool, replicas: int | None = None):
    if create:
        store, _found = await ensure_object_store(js, CODE_STORE_CONFIG, replicas=replicas)
        return store
    return await js.object_store(subjects.CODE_BUCKET)


async def upload(js: JetStreamContext, folder: str | os.PathLike, *, replicas: int | None = None) -> str:
    """Pack ``folder`` and store it in ``dilu-code`` unless a bundle with its digest is there;
    returns the key. ``dilu-code`` is created with ``replicas`` (None: one) when missing; an
    existing store is used as it is (differences logged). Raises BundleError (see :func:`pack`)."""
    data, key = pack(folder)
    store = await _store(js, create=True, replicas=replicas)
    try:
        await store.get_info(key)
        return key
    except ObjectNotFoundError:
        pass
    await store.put(key, data)
    return key


def cache_root() -> Path:
    """Where bundles are unpacked: ``$DILU_CODE_CACHE``, else ``$XDG_CACHE_HOME/dilu/code``
    (``~/.cache/dilu/code``)."""
    if os.environ.get("DILU_CODE_CACHE"):
        return Path(os.environ["DILU_CODE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dilu" / "code"


async def fetch(js: JetStreamContext, key: str, root: Path | None = None) -> Path:
    """The folder holding bundle ``key`` unpacked (fetched and unpacked on first use; a folder
    is only ever renamed into place whole, so concurrent instances never see half of one).

    Raises BundleError when the bundle is not in ``dilu-code`` or its digest does not match.
    """
    root = root or cache_root()
    target = root / key
    if target.is_dir():
        return target
    try:
        store = await _store(js, create=False)
        result = await store.get(key)
    except (NotFoundError, ObjectNotFoundError):
        raise BundleError(f"code bundle {key!r} is not in the {subjects.CODE_BUCKET!r} object store") from None
    data = result.data or b""
    if "sha256-" + hashlib.sha256(data).hexdigest() != key:
        raise BundleError(f"code bundle {key!r} does not match its digest")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for name in zf.namelist():  # no absolute paths or '..' escaping the folder
                if name.startswith("/") or ".." in Path(name).parts:
                    raise BundleError(f"code bundle {key!r} holds an unsafe path {name!r}")
            zf.extractall(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another instance unpacked it first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
