"""Every entry point answers ``--help`` with its usage and exit code 0, run as a user runs it:
``torchx run llamarl.llamarl --help``, each ``python -m llamarl.app.roles.<role>``, and the
dashboard's flags. The commands run side by side (each imports torch: seconds apiece)."""

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROLES = ["trainer", "launch", "generator", "reward", "local", "stop", "warmstart", "torchrun"]
# What each usage must mention, so a --help that printed another command's text fails.
MUST_SAY = {
    "trainer": "--max-staleness", "launch": "--max-staleness", "generator": "--store-addr",
    "reward": "--store-addr", "local": "--steps", "stop": "--app-id", "warmstart": "--out",
    "torchrun": "--nproc-per-node",
}


@pytest.mark.slow
def test_every_entry_point_prints_its_help(tmp_path):
    torchx = str(Path(sys.executable).with_name("torchx"))
    commands = {f"python -m llamarl.app.roles.{r}": [sys.executable, "-m", f"llamarl.app.roles.{r}", "--help"]
                for r in ROLES}
    commands["torchx run llamarl.llamarl --help"] = [torchx, "run", "llamarl.llamarl", "--help"]
    # From a directory outside the repository: the installed namespace, not the checkout's folders.
    procs = {name: subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}
    outputs = {name: (p.communicate(timeout=300)[0], p.returncode) for name, p in procs.items()}
    for role in ROLES:
        out, code = outputs[f"python -m llamarl.app.roles.{role}"]
        assert code == 0 and out.startswith("usage:") and MUST_SAY[role] in out, (role, out[-2000:])
    # The single-process loop's usage lists the trainer's flags, each field's docstring as its help.
    out = outputs["python -m llamarl.app.roles.local"][0]
    for flag in ("--policy", "--steps", "--rho-max", "--normaliser", "--max-staleness", "--rewards",
                 "--temperature", "--max-new-tokens", "--normalize-std", "--no-normalize-std"):
        assert flag in out, flag
    assert "AIPO truncation" in out
    out, code = outputs["torchx run llamarl.llamarl --help"]
    assert code == 0, out[-2000:]
    assert "--num_generators" in out and "--store_port" in out and "crc32" in out, out[-2000:]


def test_the_dashboard_prints_its_flags_and_opens_on_the_default():
    from llamarl.dashboard import app  # importing the page runs nothing (streamlit runs it as __main__)

    assert "--runs" in app.parser().format_help()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert app.runs_dir_from_args(["--help"]) == Path("runs")
    assert printed.getvalue().startswith("usage: streamlit run dashboard/app.py --")
    assert app.runs_dir_from_args(["--runs", "elsewhere"]) == Path("elsewhere")
