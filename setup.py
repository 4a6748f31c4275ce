"""Maps the top-level folders onto the `dilu.*` import names (DESIGN.md section 3).

`dilu.contracts` -> contracts/, `dilu.services` -> services/, and so on; `dilu` itself is an
implicit namespace package. Works for regular and editable installs.
"""
from setuptools import find_packages, setup

FOLDERS = ["contracts", "services", "loadgen", "interceptor", "cli"]

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
