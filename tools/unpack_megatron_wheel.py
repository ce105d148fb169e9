"""Unpack a megatron-core wheel's ``megatron/`` package into this interpreter's site-packages (used
by ``make setup``).

Megatron-Core 0.17 and later declare Python >= 3.12 and publish cp312 wheels only, yet
``megatron/core`` is pure Python that imports and runs on 3.11 (its one compiled helper, for
datasets, is not used here). Unpacking the package without installing it lets the 3.11 test
environment run the real Megatron-Core. A ``megatron/`` already there is replaced whole, so
switching versions leaves no stale module behind.

Usage: python tools/unpack_megatron_wheel.py WHEEL
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path


def unpack(wheel: Path, site_packages: Path) -> int:
    """Extract ``megatron/`` from ``wheel`` into ``site_packages``; the number of files written."""
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.startswith("megatron/")]
        if not members:
            raise ValueError(f"{wheel} holds no megatron/ package")
        shutil.rmtree(site_packages / "megatron", ignore_errors=True)
        archive.extractall(site_packages, members)
    return len(members)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    wheel = Path(argv[0])
    if not wheel.is_file():
        print(f"no such wheel: {wheel}", file=sys.stderr)
        return 2
    site_packages = Path(sysconfig.get_paths()["purelib"])
    count = unpack(wheel, site_packages)
    print(f"unpacked {count} files of {wheel.name} into {site_packages}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
