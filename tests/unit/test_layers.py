"""The dependency rules of DESIGN.md, enforced with import-linter on the real import graph."""

import shutil
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "lint-imports missing: it comes with the test extra (import-linter)"
    r = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "broken" in r.stdout and " 0 broken" in r.stdout
