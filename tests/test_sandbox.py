"""The sandboxed Python tool: a run that hangs, crashes, prints 100 MB or forks is
contained (killed with its children, output capped, the run here goes on) and counted."""

import os
import time

import pytest

from llamarl.app.envs import TOOL_RAISED, call_tools
from llamarl.app.envs.sandbox import PythonSandbox, SandboxLimits, namespaces


@pytest.fixture
def sandbox():
    return PythonSandbox(SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, output_bytes=4096))


def test_runs_code_and_names_each_failure(sandbox):
    assert sandbox.run("print(6 * 7)").output == "42\n"
    hung = sandbox.run("import time\ntime.sleep(60)")
    crashed = sandbox.run("import ctypes\nctypes.string_at(0)")  # a segfault
    flood = sandbox.run("import sys\nsys.stdout.write('x' * 100_000_000)")
    hog = sandbox.run("x = bytearray(1 << 30)")
    assert (hung.reason, flood.reason, hog.reason) == ("timeout", "output_limit", "memory_limit")
    assert crashed.reason in ("error", "killed") and crashed.returncode != 0
    assert len(flood.output) == 4096
    assert sandbox.counts == {"ok": 1, "timeout": 1, crashed.reason: 1, "output_limit": 1, "memory_limit": 1}


def test_forked_children_die_with_the_run(sandbox, tmp_path):
    beat = tmp_path / "beat"
    # One child stays in the group; with namespaces, another leaves it with setsid.
    escape = "os.setsid()" if namespaces() else "pass"
    code = f"""import os, time
for i in range(2):
    if os.fork() == 0:
        if i:
            {escape}
        while True:
            open({str(beat)!r}, "a").write("x")
            time.sleep(0.05)
time.sleep(0.5)
"""
    assert sandbox.run(code).reason == "ok"
    time.sleep(0.3)
    size = beat.stat().st_size
    assert size > 0
    time.sleep(0.5)
    assert beat.stat().st_size == size  # nobody is writing any more


@pytest.mark.skipif(not namespaces(), reason="no user namespaces here: the network is not isolated")
def test_no_network(sandbox):
    out = sandbox.run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)")
    assert out.reason == "error" and "unreachable" in out.output


def test_the_tool_tells_the_model_and_counts_the_failure(sandbox):
    step = call_tools('<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>',
                      [sandbox.tool()])
    assert step.tool_errors == (TOOL_RAISED,)
    assert any(f"stopped ({r})" in step.observation[0]["content"] for r in ("timeout", "cpu_limit"))
    scratch = sandbox.run("import os\nprint(os.getcwd())").output.strip()
    assert scratch and not os.path.exists(scratch)  # the scratch directory goes with the run
