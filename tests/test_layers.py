"""The import layers and the absence of import circles (pyproject.toml's [tool.importlinter]), checked
with import-linter on every test run.

import-linter finds a package's modules by walking its folder, and three of hetero_sd's subpackages
live in the repository's top-level folders (backends/, ane_compiler/, tui/: the design card's layout,
shipped as hetero_sd.backends, ... through setuptools' package-dir). So the check runs on a copy laid
out as installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"backends": "backends", "ane_compiler": "ane_compiler", "tui": "tui"}  # hetero_sd.<name> <- <folder>


def installed_layout(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "data")
    # (a checkout laid out as the package, as benchmarks/gpu_check.py leaves one, links the mapped folders inside)
    shutil.copytree(ROOT / "hetero_sd", dest / "hetero_sd",
                    ignore=lambda folder, names: set(ignore(folder, names)) | (set(MAPPED) & set(names)))
    for name, folder in MAPPED.items():
        shutil.copytree(ROOT / folder, dest / "hetero_sd" / name, ignore=ignore)
    (dest / "hetero_sd" / "data").mkdir()
    (dest / "hetero_sd" / "data" / "__init__.py").write_text("")
    return dest


def test_import_layers_and_no_circles(tmp_path):
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "import-linter is a dev dependency: pip install -e '.[dev]'"
    tree = installed_layout(tmp_path)
    out = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
