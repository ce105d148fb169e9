"""An older Megatron-Core without the GTP fields (0.16.1): parity of its fields, from_megatron leaves the GTP fields
UNSET, to_megatron leaves them out while they carry nothing and refuses a layout that needs them.

That release cannot share a process with the newer one the other tests import, so the checks run in a subprocess
(older_release_checks.py) with it first on the path; ``make setup`` installs it and ``make test`` names its folder
in PGREGISTRY_OLDER_MEGATRON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _older_release() -> Path:
    folder = os.environ.get("PGREGISTRY_OLDER_MEGATRON", "")
    if not folder or not (Path(folder) / "megatron" / "core").is_dir():
        if os.environ.get("PGREGISTRY_REQUIRE_MEGATRON") == "1":
            raise RuntimeError(f"PGREGISTRY_OLDER_MEGATRON={folder!r} holds no megatron/core; run make setup")
        pytest.skip("no older Megatron-Core installed (PGREGISTRY_OLDER_MEGATRON); make test sets it")
    return Path(folder)


def test_older_megatron_without_gtp_fields() -> None:
    folder = _older_release()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(HERE.parents[1])])}
    done = subprocess.run(
        [sys.executable, str(HERE / "older_release_checks.py")], env=env, capture_output=True, text=True,
        timeout=90, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "gtp_remat" not in report["fields"] and "tp_dp_cp" in report["fields"], report["version"]
    for rank, result in enumerate(report["ranks"]):
        assert result["parity_wrong"] == [], rank
        assert len(result["unset_gtp_fields"]) == 5, rank
        assert result["to_megatron_fields"] == sorted(report["fields"]), rank
        assert "has no 'gtp_remat' field" in result["gtp_refused"], rank
        assert "has no 'gtp_weight_remat_size'" in result["gtp_config_refused"], rank
