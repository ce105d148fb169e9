"""The versions the README says ``make setup`` installs are the Makefile's, and its set-up names each.

The README's set-up names the CPU torch, both Megatron-Core releases, torchtitan and the migration's
corpus (Megatron-Bridge, NeMo) by version; the Makefile's variables decide them. A version bumped in
the Makefile alone would leave the README naming a release the suite no longer runs against.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# README's name of each package -> the Makefile variables whose versions it may carry.
NAMES = {
    r"CPU torch": ("TORCH_CPU",),
    r"[Mm]egatron-[Cc]ore": ("MEGATRON_CORE", "MEGATRON_CORE_OLDER"),
    r"torchtitan": ("TORCHTITAN",),
    r"Megatron-Bridge": ("CORPUS",),
    r"NeMo": ("CORPUS",),
}
_VERSION = r"\d+\.\d+\.\d+"


def makefile_versions(makefile: str) -> dict[str, list[str]]:
    """Each ``NAME ?= ...`` variable of ``makefile`` -> the versions its value names."""
    return {
        name: re.findall(_VERSION, value)
        for name, value in re.findall(r"^(\w+) \?= (.+)$", makefile, re.MULTILINE)
    }


def stale_versions(readme: str, makefile: str) -> list[str]:
    """Each ``package X.Y.Z`` of ``readme`` (``... X.Y.Z and X.Y.Z`` too) its variables do not name."""
    versions = makefile_versions(makefile)
    stale = []
    for name, variables in NAMES.items():
        allowed = {version for variable in variables for version in versions[variable]}
        for found in re.finditer(rf"\b{name} ({_VERSION}(?: and {_VERSION})?)", readme):
            stale += [f"{name} {v}" for v in re.findall(_VERSION, found[1]) if v not in allowed]
    return stale


def test_the_readme_names_the_makefile_s_versions() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert stale_versions(readme, makefile) == []
    setup = readme.split("### Installing into your own environment", 1)[1].split("\n## ", 1)[0]
    versions = makefile_versions(makefile)
    wanted = ("TORCH_CPU", "MEGATRON_CORE", "MEGATRON_CORE_OLDER", "TORCHTITAN", "CORPUS")
    assert [f"{name} {v}" for name in wanted for v in versions[name] if v not in setup] == []


def test_a_version_the_makefile_left_is_found() -> None:
    makefile = "MEGATRON_CORE ?= 0.19.2\nMEGATRON_CORE_OLDER ?= 0.16.1\nTORCHTITAN ?= 0.3.0\n"
    makefile += "TORCH_CPU ?= torch==2.13.0\nCORPUS ?= megatron-bridge==0.6.2 nemo-toolkit==3.0.0\n"
    readme = "downloads Megatron-Core 0.19.1 and 0.16.1, torchtitan 0.3.0; megatron-core 0.19.2"
    assert stale_versions(readme, makefile) == ["[Mm]egatron-[Cc]ore 0.19.1"]
