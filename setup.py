"""Maps the top-level folders onto the `dilu.*` import names (DESIGN.md section 3), and builds
the native parts at install time.

`dilu.contracts` -> contracts/, `dilu.services` -> services/, and so on; `dilu` itself is an
implicit namespace package. Works for regular and editable installs.

The interceptor, the fake CUDA driver and NVML and the cffi module are compiled by
interceptor/build.py during `build_py`: into the built package for a regular install (so they
land in site-packages), into interceptor/build/ for an editable one. Nothing is compiled when a
service starts (a hardened unit cannot write to its package folder).
"""
import importlib.util
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class build_py_native(build_py):
    """``build_py`` plus the native build (interceptor/build.py, loaded by path: the package is
    not importable while it is being built)."""

    def run(self):
        super().run()
        spec = importlib.util.spec_from_file_location("dilu_native_build", HERE / "interceptor" / "build.py")
        native = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native)
        if getattr(self, "editable_mode", False):
            out = native.BUILD
        else:
            out = Path(self.build_lib) / "dilu" / "interceptor" / "build"
        native.build(verbose=True, out=out)

FOLDERS = ["contracts", "services", "loadgen", "interceptor", "cli", "client"]

packages: list[str] = []
package_dir: dict[str, str] = {}
for folder in FOLDERS:
    top = f"dilu.{folder}"
    packages.append(top)
    package_dir[top] = folder
    packages += [f"{top}.{sub}" for sub in find_packages(folder)]
# folders of data files only (schemas, C sources, traces, surfaces), listed so that setuptools
# installs them as package data without a deprecation warning each
packages += ["dilu.contracts.schema", "dilu.interceptor.tools", "dilu.loadgen.data",
             "dilu.services.common.surfaces", "dilu.services.scheduler.workloads"]

setup(
    cmdclass={"build_py": build_py_native},
    packages=packages,
    package_dir=package_dir,
    package_data={
        "dilu.interceptor": ["*.h", "*.c", "tools/*.c", "README.md"],
        "dilu.loadgen": ["data/*/*", "data/*"],
        "dilu.contracts": ["schema/*.json"],
        "dilu.services.common": ["surfaces/*/*.csv", "surfaces/*.md"],
        "dilu.services.profiler": ["surfaces/*/*.csv", "surfaces/*.md"],
        "dilu.services.scheduler": ["workloads/*.txt", "workloads/*.md"],
    },
)
