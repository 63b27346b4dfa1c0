"""Reward components in worker processes: a hung call is killed with its process, a crash
is contained, workers never outlive their parent, and inline built-ins start none.

The components are in tests/reward_fixtures.py (a worker imports them by name). Waits
for a process to end are bounded polls, not timing assertions.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import reward_fixtures as fixtures
from llamarl.app.rewards import Component, CompositeReward, RewardWorkerError, Sample, build_reward

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")


def alive(pid: int) -> bool:
    """Running or sleeping; False once it has exited (a zombie is dead too)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for_file(directory: Path, timeout_s: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while not (files := list(directory.iterdir())):
        assert time.monotonic() < deadline, f"nothing appeared in {directory} in {timeout_s:g} s"
        time.sleep(0.05)
    return files[0]


def recorded_pids(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir())


def samples(*completions: str, **meta) -> list[Sample]:
    return [Sample("p", c, dict(meta)) for c in completions]


def composite(*fns, timeout_s: float = 30.0) -> CompositeReward:
    return CompositeReward([Component(name=f"c{i}", fn=f) for i, f in enumerate(fns)], timeout_s=timeout_s)


def test_a_hung_call_is_killed_with_its_worker_and_the_run_goes_on(tmp_path):
    with composite(fixtures.one, fixtures.hangs_on_long, timeout_s=1.0) as reward:
        results = reward.score(samples(" short", " long", " short", " long", " short", pid_dir=str(tmp_path)))
        assert [r.quarantined for r in results] == [None, "timeout", None, "timeout", None]
        assert [r.total for r in results] == [2.0, None, 2.0, None, 2.0]
        hung = recorded_pids(tmp_path)
        assert len(hung) == 2 and not any(alive(pid) for pid in hung)  # killed and reaped
        assert reward.worker_pids()["c1"] not in hung and alive(reward.worker_pids()["c1"])
        assert [r.total for r in reward.score(samples(" short"))] == [2.0]


def test_a_hung_batch_is_killed_and_the_next_batch_is_scored(tmp_path):
    with composite(fixtures.Batched("lengths"), timeout_s=1.0) as reward:
        results = reward.score(samples(" ab", " hang", " abc", pid_dir=str(tmp_path)))
        assert [r.quarantined for r in results] == ["timeout"] * 3
        [hung] = recorded_pids(tmp_path)
        assert not alive(hung)
        assert [r.total for r in reward.score(samples(" ab", " abc"))] == [3.0, 4.0]


def test_a_crashed_worker_is_replaced_and_later_samples_are_scored(tmp_path, caplog):
    with composite(fixtures.dies_on_request) as reward, caplog.at_level(logging.WARNING):
        results = reward.score(samples(" ok", " segv", " ok", " abort", " ok", pid_dir=str(tmp_path)))
    assert [r.quarantined for r in results] == [None, "crashed", None, "crashed", None]
    first, second, third = (int(results[i].total) for i in (0, 2, 4))
    assert first != second != third  # a fresh worker after each crash
    assert recorded_pids(tmp_path) == sorted([first, second]) and not alive(first) and not alive(second)
    assert "killed by SIGSEGV" in caplog.text and "killed by SIGABRT" in caplog.text


def test_prints_of_a_component_reach_stderr_not_the_protocol(capfd):
    with composite(fixtures.chatty) as reward:
        assert [r.total for r in reward.score(samples(" a", " b"))] == [1.0, 1.0]
    err = capfd.readouterr().err
    assert err.count("chatty reward: hello from print") == 2 and err.count("chatty reward: hello from fd 1") == 2


def test_a_lambda_or_a_nested_function_is_refused_when_the_composite_is_built():
    def nested(prompt, completion, meta):
        return 1.0

    for fn in (lambda p, c, m: 1.0, nested):
        with pytest.raises(TypeError, match="'mine' runs in a worker process, so it must be picklable: "
                                            "define it at module level"):
            CompositeReward([Component(name="mine", fn=fn)])


def test_inline_builtins_start_no_worker_and_load_starts_the_others():
    builtins = build_reward("math_verifier,format,length_penalty")
    builtins.load()
    assert [r.quarantined for r in builtins.score(samples(" #### 7", answer=7))] == [None]
    assert builtins.worker_pids() == {}

    with composite(fixtures.pid, fixtures.one) as reward:
        reward.load()
        pids = reward.worker_pids()
        assert set(pids) == {"c0", "c1"} and all(alive(p) for p in pids.values())
        [r] = reward.score(samples(" a"))
        assert r.components["c0"] == pids["c0"] and reward.worker_pids() == pids  # no new worker


def test_close_and_collection_leave_no_worker_process():
    reward = composite(fixtures.one, fixtures.Batched())
    reward.load()
    pids = list(reward.worker_pids().values())
    reward.close()
    assert reward.worker_pids() == {} and not any(alive(p) for p in pids)  # reaped by close

    reward = composite(fixtures.one)
    reward.load()
    [pid] = reward.worker_pids().values()
    del reward
    gc.collect()
    assert not alive(pid)


def test_a_worker_started_by_a_thread_that_has_ended_still_serves():
    """PR_SET_PDEATHSIG fires when the *thread* that started a child ends; workers are
    started by one long-lived thread, so a short-lived scoring thread does not kill them."""
    with composite(fixtures.pid) as reward:
        out = []
        thread = threading.Thread(target=lambda: out.append(reward.score(samples(" a"))))
        thread.start()
        thread.join()
        [[first]] = out
        [again] = reward.score(samples(" b"))
        assert first.quarantined is None and again.quarantined is None
        assert again.total == first.total  # the same worker, not a replacement


def test_a_worker_that_cannot_load_is_a_clear_error():
    with pytest.raises(RewardWorkerError, match="'broken' cannot start in its worker process: "
                                                "RuntimeError: no model at /nowhere"):
        CompositeReward([Component(name="broken", fn=fixtures.FailsToLoad())]).load()
    reward = CompositeReward([Component(name="aborts", fn=fixtures.AbortsOnLoad())])
    with pytest.raises(RewardWorkerError, match="'aborts': its worker process died before it was ready "
                                                "3 times in a row \\(killed by SIGABRT\\)"):
        reward.score(samples(" a"))  # started on first use: the same rules
    assert reward.worker_pids() == {}


def test_a_module_gone_from_the_worker_path_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "llamarl_vanishing_reward.py").write_text("def gone(prompt, completion, meta):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = build_reward("llamarl_vanishing_reward:gone")
    (tmp_path / "llamarl_vanishing_reward.py").unlink()
    with pytest.raises(RewardWorkerError, match="'gone' cannot start.*ModuleNotFoundError.*llamarl_vanishing_reward"):
        reward.load()


def test_a_call_interrupted_in_the_parent_leaves_no_stale_results(monkeypatch):
    """Ctrl-C while waiting: the worker may still answer the old request; those lines must
    not be taken for the next request's."""
    from llamarl.app.rewards.worker import WorkerProcess

    with composite(fixtures.level) as reward:
        reward.load()
        read_line = WorkerProcess._read_line

        def interrupted(self, deadline):
            monkeypatch.setattr(WorkerProcess, "_read_line", read_line)
            time.sleep(0.5)  # the worker answers the request meanwhile
            raise KeyboardInterrupt

        monkeypatch.setattr(WorkerProcess, "_read_line", interrupted)
        with pytest.raises(KeyboardInterrupt):
            reward.score([Sample("p", "c", {"level": 1}), Sample("p", "c", {"level": 2})])
        assert [r.total for r in reward.score([Sample("p", "c", {"level": 3})])] == [3.0]


def test_a_worker_uses_the_torch_threads_of_its_parent():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2 if before != 2 else 1)
    try:
        with composite(fixtures.TorchThreads()) as reward:
            [r] = reward.score(samples(" a"))
        assert r.total == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _script(tmp_path: Path, source: str) -> Path:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return script


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}


def test_workers_die_when_their_parent_is_killed(tmp_path):
    """SIGKILL leaves the parent no chance to clean up, and the worker is inside a hung
    call, not reading its stdin: only PR_SET_PDEATHSIG can end it."""
    script = _script(tmp_path, """
        import sys
        import reward_fixtures
        from llamarl.app.rewards import Component, CompositeReward, Sample

        reward = CompositeReward([Component(name="hang", fn=reward_fixtures.hangs_on_long)], timeout_s=3600)
        reward.score([Sample("p", " long", {"pid_dir": sys.argv[1]})])
    """)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    parent = subprocess.Popen([sys.executable, str(script), str(pid_dir)], env=_env(), cwd=REPO)
    worker = None
    try:
        worker = int(wait_for_file(pid_dir).name)
        assert alive(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert wait_dead(worker), "the worker outlived its SIGKILLed parent"
    finally:
        parent.kill()
        if worker is not None and alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_process_whose_reward_hung_in_torch_ends_normally(tmp_path):
    """The parent imports torch, a reward hung inside torch was timed out, and the process
    ends without closing the composite: interpreter teardown runs (atexit handlers too; no
    os._exit), the exit status is 0, and no worker is left behind."""
    script = _script(tmp_path, """
        import atexit
        import sys
        import torch
        import reward_fixtures
        from llamarl.app.rewards import Component, CompositeReward, Sample

        atexit.register(lambda: print("atexit ran", flush=True))
        reward = CompositeReward([Component(name="spin", fn=reward_fixtures.SpinsInTorch()),
                                  Component(name="idle", fn=reward_fixtures.pid)], timeout_s=2.0)
        reward.load()
        [result] = reward.score([Sample("p", "c", {"pid_dir": sys.argv[1]})])
        print("quarantined:", result.quarantined, "idle:", reward.worker_pids()["idle"], flush=True)
    """)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.run([sys.executable, str(script), str(pid_dir)], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quarantined: timeout idle:" in proc.stdout and "atexit ran" in proc.stdout
    assert "terminate called" not in proc.stderr and "Exception ignored" not in proc.stderr
    [spun] = recorded_pids(pid_dir)
    idle = int(proc.stdout.split("idle:")[1].split()[0])
    assert wait_dead(spun) and wait_dead(idle)


@pytest.mark.parametrize("completion, timeout_s", [("done", 30.0), ("hang", 2.0)])
def test_processes_a_component_starts_end_with_its_worker(tmp_path, completion, timeout_s):
    """A component's own children (here a ``sleep``) end when its worker is closed (the call
    returned) or killed (the call hung past its timeout): each worker leads a process group
    of its own, which is killed whole."""
    reward = composite(fixtures.forks_a_sleeper, timeout_s=timeout_s)
    reward.score(samples(completion, pid_dir=str(tmp_path)))
    [child] = recorded_pids(tmp_path)
    reward.close()
    assert wait_dead(child), f"the component's child {child} outlived its worker"
