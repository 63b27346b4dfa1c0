"""Input a user got wrong ends a role on its one line (exit code 1, no traceback above it),
as ``python -m llamarl.app.roles.local`` shows it: a runs directory that is a file, a run id
too long for a file name, a policy directory without its tokenizer or with corrupt weights.
And the unit refusals underneath: a store port another program holds."""

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llamarl.app.control.runtime import host_app_store
from llamarl.app.errors import ConfigError


def run_local(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llamarl.app.roles.local", "--steps", "1", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def assert_one_line_refusal(done: subprocess.CompletedProcess, says: str) -> None:
    # 2: a flag's value, refused by the parser below its usage, as argparse does; 1: an input.
    assert done.returncode == (2 if says.startswith("run_id") else 1), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert says in done.stderr.strip().splitlines()[-1], done.stderr[-3000:]


@pytest.mark.slow
def test_bad_runs_dirs_run_ids_and_policy_directories_end_on_one_line(tiny_policy, tmp_path):
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_policy, no_tokenizer)
    for f in no_tokenizer.glob("tokenizer*"):
        f.unlink()
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_policy, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    (tmp_path / "a-file").write_text("")
    cases = {
        "its tokenizer does not load": ["--policy", str(no_tokenizer)],
        "its weights do not load (SafetensorError": ["--policy", str(corrupt)],
        "is a file, not a directory": ["--policy", str(tiny_policy), "--runs-dir", str(tmp_path / "a-file")],
        "run_id must be at most 200 characters, got 300": ["--policy", str(tiny_policy), "--run-id", "r" * 300],
    }
    for says, args in cases.items():
        assert_one_line_refusal(run_local(*args, cwd=tmp_path), says)


def test_a_store_port_another_program_holds_is_a_refusal_naming_it():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot host the control store on port {port} .*Address already in use"
                                              f".*--store_port"):
            host_app_store(port, "llamarl-x", bind="127.0.0.1")
