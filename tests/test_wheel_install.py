"""The built wheel, installed into a fresh virtualenv beside a user's own ``app`` package,
runs a 2-step app as ``python -m llamarl.app.roles.local`` and as ``torchx run -s
local_llamarl llamarl.llamarl``, and the user's ``app``, ``components`` and ``dashboard``
stay theirs: installing llamarl adds one top-level import package, ``llamarl``.

The fresh venv borrows its dependencies (torch, torchx, transformers, ...) from the running
one through a ``.pth`` file that names the running venv's site-packages as a plain path: a
path line does not process that directory's own ``.pth`` files, so the running venv's
editable-install finder stays off, and ``llamarl`` can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from app_launch import SMALL
from llamarl.app.names import free_port

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "app", "components", "pipelines", "dashboard"]
"""What the wheel is built from (pyproject.toml's package-dir), copied so that the build's
``build/`` and ``*.egg-info`` land in a temporary directory, not in the checkout."""
USER_PACKAGES = ["app", "components", "dashboard"]
TIMEOUT_S = 600


def run(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def fresh_venv_with_wheel(tmp: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """(the fresh venv's python, its site-packages), llamarl installed there from a wheel
    built here without the network (setuptools from the running venv)."""
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    wheels = tmp / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "-w", str(wheels), str(src)], cwd=tmp, env=env)
    (wheel,) = wheels.glob("llamarl-*.whl")

    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
         "--quiet", str(wheel)], cwd=tmp, env=env)
    site_packages = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             cwd=tmp, env=env).strip())
    borrowed = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site_packages / "borrowed_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(borrowed)))
    return python, site_packages


def user_project(root: Path) -> None:
    """A user's project whose top-level packages share the names of llamarl's folders."""
    for name in USER_PACKAGES:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("OWNER = 'user'\n")


def trainer_steps(db_path: Path) -> int:
    with sqlite3.connect(db_path) as db:
        (step,) = db.execute("SELECT max(step) FROM scalars WHERE role = 'trainer'").fetchone()
    return step


@pytest.mark.slow
@pytest.mark.integration
def test_the_wheel_runs_beside_a_users_app_package(tiny_policy, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    python, site_packages = fresh_venv_with_wheel(tmp_path, env)
    work = tmp_path / "project"
    user_project(work)

    # Which modules the fresh interpreter resolves, run from the user's project (the current
    # directory comes first on sys.path, as under `python -m`).
    where = json.loads(run([str(python), "-c", (
        "import json, app, components, dashboard, llamarl.app.roles.local, llamarl.components.llamarl, "
        "llamarl.dashboard.data\n"
        "print(json.dumps({'owners': [m.OWNER for m in (app, components, dashboard)], "
        "'llamarl': [llamarl.app.roles.local.__file__, llamarl.components.llamarl.__file__, "
        "llamarl.dashboard.data.__file__]}))")], cwd=work, env=env))
    assert where["owners"] == ["user"] * 3
    for path in where["llamarl"]:
        assert Path(path).is_relative_to(site_packages), (path, "llamarl is not the wheel's")

    out = run([str(python), "-m", "llamarl.app.roles.local", "--steps", "2", "--policy", str(tiny_policy),
               "--run-id", "local", *SMALL], cwd=work, env=env)
    assert "done in" in out, out
    assert trainer_steps(work / "runs" / "local" / "metrics.db") == 2

    runs = work / "torchx-runs"
    # No --wait: as the README's `torchx run`, which waits only because the scheduler's name
    # starts with "local" (torchx's cmd_run.py; its runner's close stops an app it did not wait for).
    out = run([str(python), "-m", "torchx.cli.main", "run", "-s", "local_llamarl",
               "-cfg", f"log_dir={tmp_path / 'torchx-logs'}", "llamarl.llamarl", "--steps", "2",
               "--policy", str(tiny_policy), "--runs_dir", str(runs), "--store_port", str(free_port()),
               "--secret_file", str(tmp_path / "secret"), "--", *SMALL], cwd=work, env=env)
    (db_path,) = runs.glob("*/metrics.db")
    assert trainer_steps(db_path) == 2, out
    # The app's roles ran from the user's project and left its packages as they were.
    for name in USER_PACKAGES:
        assert (work / name / "__init__.py").read_text() == "OWNER = 'user'\n"
