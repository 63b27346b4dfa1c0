"""The layer contract of docs/architecture.md ("Packages and layers"): pyproject.toml's
[tool.importlinter] contracts, checked by import-linter over the installed ``llamarl``
namespace. An upward import (a plane importing ``roles``, the dashboard importing the
trainer, pure math importing the store) fails this test and ``.ci/run``."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_import_points_down_the_layers(tmp_path):
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache", str(REPO / "pyproject.toml")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout, done.stdout[-4000:]


def test_nothing_imports_the_repository_folders_by_their_old_top_level_names():
    """Installed, the only top-level package is ``llamarl``: a module importing ``app.x`` or
    ``pipelines.x`` works from a checkout and breaks in a wheel (and beside a user's ``app``)."""
    bad = []
    for folder in ("app", "pipelines", "components", "dashboard", "tests", "benchmarks", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                stripped = line.strip()
                if stripped.startswith(("import ", "from ")) and stripped.split()[1].split(".")[0] in (
                        "app", "pipelines", "components", "dashboard"):
                    bad.append(f"{path.relative_to(REPO)}:{n}: {stripped}")
    assert not bad, "\n".join(bad)
