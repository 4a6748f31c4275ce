"""Builds the native pieces from source with the system C compiler (``cc``, or ``$CC``).

Outputs, all under one folder, by default ``interceptor/build/`` (ignored by git; nothing
prebuilt is committed). Installing the package builds them (``pip install`` runs this from
setup.py, into the installed package; an editable install and ``make`` build in place), so no
service ever compiles or writes into its package folder at run time:

- ``libdilu_intercept.so``  the LD_PRELOAD interceptor (interceptor.c)
- ``fake/libcuda.so.1``     the fake CUDA driver (fake_driver.c), with a ``libcuda.so`` link
- ``fake/libnvidia-ml.so.1`` the fake NVML (fake_nvml.c) the emulated node's agent loads
- ``bin/dilu_launch``       a small C program driving the driver API (tools/dilu_launch.c),
                            linked directly against ``libcuda.so.1``
- ``_dilu_cb*.so``          the cffi API-mode module over dilu_cb.h (control block helpers)

``python -m dilu.interceptor.build`` builds what is out of date (compares modification times
with the sources), so a second run is quick. A file lock makes concurrent builds safe.
Raises ``BuildError`` with the compiler's output when a step fails.
"""
from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent
BUILD = SRC / "build"
HEADERS = [SRC / "dilu_cb.h", SRC / "dilu_cb_layout.h", SRC / "dilu_cuda_min.h", SRC / "dilu_fake_gpu.h"]
CFLAGS = ["-O2", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fPIC", "-std=gnu11"]

CFFI_MODULE = "_dilu_cb"
# C helpers the Python binding calls; declared for the cdef next to the verbatim layout.
CFFI_HELPERS = """
uint64_t dilu_now_ns(void);
uint64_t dilu_load_u64(const uint64_t *p);
void dilu_store_u64(uint64_t *p, uint64_t v);
uint32_t dilu_load_u32(const uint32_t *p);
int dilu_futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns);
int dilu_futex_wake(uint32_t *addr, int n);
void dilu_cb_init(struct dilu_cb *cb, const char *instance_id, uint64_t request_ppm,
                  uint64_t width_ppm, uint64_t stale_after_ns, uint64_t mem_limit_bytes);
void dilu_cb_heartbeat(struct dilu_cb *cb);
uint32_t dilu_cb_write_grant(struct dilu_cb *cb, uint64_t quota_ppm);
void dilu_cb_snapshot(const struct dilu_cb *cb, struct dilu_cb *out);
void dilu_cb_set_runtime(struct dilu_cb *cb, uint64_t ready, uint64_t requests,
                         uint64_t latency_us_ewma, uint64_t queue_depth);
#define DILU_CB_MAGIC ...
#define DILU_CB_LAYOUT_VERSION ...
#define DILU_CB_FLAG_STALE ...
#define DILU_CB_FLAG_TORN_GRANT ...
"""


class BuildError(RuntimeError):
    """A compiler step failed; the message holds the command and its output."""


def _cc() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc"))


def _stale(target: Path, sources: list[Path]) -> bool:
    if not target.exists():
        return True
    t = target.stat().st_mtime
    return any(s.stat().st_mtime > t for s in sources)


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"{shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")


def _shared(target: Path, source: Path, extra: list[str], soname: str | None = None) -> bool:
    """Compiles ``source`` into the shared object ``target`` when out of date; True if it did."""
    if not _stale(target, [source, *HEADERS, Path(__file__)]):
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    cmd = [*_cc(), *CFLAGS, f"-I{SRC}", "-shared", "-o", str(tmp), str(source)]
    if soname:
        cmd.append(f"-Wl,-soname,{soname}")
    _run(cmd + extra)
    os.replace(tmp, target)  # atomic: a running process never maps a half-written library
    return True


def _cffi_module(out: Path) -> bool:
    existing = sorted(out.glob(f"{CFFI_MODULE}*.so"))
    if existing and not _stale(existing[0], [*HEADERS, Path(__file__)]):
        return False
    import cffi  # imported here so building the C parts needs no cffi

    ffi = cffi.FFI()
    ffi.cdef((SRC / "dilu_cb_layout.h").read_text() + CFFI_HELPERS)
    ffi.set_source(CFFI_MODULE, '#include "dilu_cb.h"', include_dirs=[str(SRC)],
                   extra_compile_args=["-O2", "-std=gnu11"])
    for old in existing:
        old.unlink()
    ffi.compile(tmpdir=str(out), verbose=False)
    for leftover in out.glob(f"{CFFI_MODULE}.[co]"):
        leftover.unlink()
    return True


def build(verbose: bool = False, out: Path = BUILD) -> list[str]:
    """Builds everything that is out of date into ``out``; returns the names of the outputs rebuilt.

    Raises BuildError when the compiler fails (its output is in the message).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rebuilt: list[str] = []
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fake = out / "fake" / "libcuda.so.1"
        if _shared(fake, SRC / "fake_driver.c", ["-lpthread", "-lrt", "-lm", "-Wl,-Bsymbolic"],
                   soname="libcuda.so.1"):
            rebuilt.append(str(fake))
        link = out / "fake" / "libcuda.so"
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to("libcuda.so.1")
        nvml = out / "fake" / "libnvidia-ml.so.1"
        if _shared(nvml, SRC / "fake_nvml.c", ["-lpthread", "-lrt", "-Wl,-Bsymbolic"], soname="libnvidia-ml.so.1"):
            rebuilt.append(str(nvml))
        lib = out / "libdilu_intercept.so"
        if _shared(lib, SRC / "interceptor.c", ["-ldl", "-lpthread", "-lm"]):
            rebuilt.append(str(lib))
        prog = out / "bin" / "dilu_launch"
        src = SRC / "tools" / "dilu_launch.c"
        if _stale(prog, [src, *HEADERS, fake]):
            prog.parent.mkdir(parents=True, exist_ok=True)
            _run([*_cc(), *CFLAGS, f"-I{SRC}", "-o", str(prog), str(src),
                  f"-L{fake.parent}", "-l:libcuda.so.1", "-ldl", "-lpthread",
                  f"-Wl,-rpath,{fake.parent}"])
            rebuilt.append(str(prog))
        if _cffi_module(out):
            rebuilt.append(CFFI_MODULE)
    if verbose:
        for name in rebuilt:
            print(f"built {name}")
        if not rebuilt:
            print(f"up to date: {out}")
    return rebuilt


def main() -> int:
    try:
        build(verbose=True)
    except BuildError as exc:
        print(f"native build failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
