"""The sandbox against hostile snippets: each test runs a few lines of Python through run_sandboxed
or spawn_sandboxed and checks the limit held and the grader's side (files, processes) is intact.

CI runs as root, where every guarantee of docs/SECURITY.md holds; the tests that need a uid of the
sandbox's own are skipped elsewhere with the reason (the fork bomb never runs without RLIMIT_NPROC
on a dedicated uid).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from grader.sandbox import (
    Limits,
    SandboxError,
    _live_pids,
    make_private,
    make_scratch,
    run_sandboxed,
    sandbox_env,
    spawn_sandboxed,
)

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: uid isolation (see docs/SECURITY.md)")
FAST = Limits(wall_s=20, cpu_s=20, memory_mb=512, nproc=64, output_kb=64)


@pytest.fixture
def scratch():
    path = make_scratch()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def py(code: str, scratch: Path, limits: Limits = FAST, **kw):
    """Run a Python snippet (no site-packages: fast start) in the sandbox."""
    return run_sandboxed([sys.executable, "-I", "-S", "-c", textwrap.dedent(code)], cwd=scratch,
                         limits=limits, **kw)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------- normal runs


def test_runs_code_and_passes_stdin_through(scratch):
    res = py("import sys; sys.stdout.write(sys.stdin.read()[::-1]); print('err', file=sys.stderr)",
             scratch, stdin=b"abc")
    assert res.ok and res.reason == ""
    assert (res.stdout, res.stderr) == (b"cba", b"err\n")
    assert not (res.timed_out or res.stdout_truncated or res.stderr_truncated)


def test_environment_is_allow_listed_and_home_is_in_scratch(scratch, monkeypatch):
    monkeypatch.setenv("ONENODE_GRADER_SECRET", "hunter2")
    (scratch / "starter_code").mkdir()
    res = py("import json, os; print(json.dumps(dict(os.environ)))", scratch)
    env = json.loads(res.stdout)
    assert "ONENODE_GRADER_SECRET" not in env and set(env) == set(sandbox_env(scratch))
    for key in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "HF_HOME", "PYTHONPATH"):
        assert Path(env[key]).is_relative_to(scratch.resolve()), key
    assert env["PYTHONPATH"] == str(scratch.resolve() / "starter_code")


@ROOT_ONLY
def test_runs_as_unprivileged_uid_without_new_privileges(scratch):
    res = py("""
        import os
        print(os.getuid(), os.getgid(), os.getgroups())
        print([l for l in open('/proc/self/status') if l.startswith('NoNewPrivs')][0].split()[1])
    """, scratch)
    ids, no_new_privs = res.stdout.decode().splitlines()
    uid = int(ids.split()[0])
    assert uid != 0 and ids == f"{uid} {uid} []" and no_new_privs == "1"


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize("bad", [{"wall_s": 0}, {"memory_mb": -1}, {"output_kb": None}])
def test_nonsense_limits_are_refused(bad):
    with pytest.raises(ValueError, match=f"Limits.{next(iter(bad))}"):
        Limits(**bad)


def test_infinite_loop_is_killed_at_wall_time(scratch):
    res = py("while True: pass", scratch, Limits(wall_s=1, cpu_s=None))
    assert res.timed_out and res.killed_reason == "wall time"
    assert res.reason == "killed: wall time 1 s exceeded"


def test_cpu_time_limit(scratch):
    res = py("while True: pass", scratch, Limits(wall_s=30, cpu_s=1))
    assert res.killed_reason == "cpu time" and not res.timed_out
    assert res.reason == "killed: CPU time 1 s exceeded"


def test_memory_exhaustion_is_out_of_memory(scratch):
    res = py("blocks = [bytearray(64 << 20) for _ in range(64)]", scratch, Limits(wall_s=20, memory_mb=256))
    assert res.returncode != 0 and res.killed_reason == "memory"
    assert res.reason == "out of memory (limit 256 MiB)"


def test_file_size_limit(scratch):
    res = py("open('big', 'wb').write(bytes(3 << 20))", scratch, Limits(wall_s=20, fsize_mb=1))
    assert res.killed_reason == "file size" and (scratch / "big").stat().st_size <= 1 << 20


def test_output_flood_is_truncated_keeping_head_and_tail(scratch):
    res = py("""
        import sys
        print('first line')
        for i in range(100000):
            print('x' * 99, file=sys.stdout)
        print('last line')
        sys.stderr.write('e' * 500000)
    """, scratch, Limits(wall_s=20, output_kb=16))
    assert res.returncode == 0 and res.stdout_truncated and res.stderr_truncated
    assert len(res.stdout) < 17 * 1024 and len(res.stderr) < 17 * 1024
    assert res.stdout.startswith(b"first line") and res.stdout.endswith(b"last line\n")
    assert b"bytes cut by the grader" in res.stdout
    assert res.reason == "stdout and stderr over 16 KiB truncated"


def test_endless_output_is_truncated_and_killed(scratch):
    res = py("while True: print('spam' * 1000)", scratch, Limits(wall_s=1, output_kb=8))
    assert res.timed_out and res.stdout_truncated and len(res.stdout) < 9 * 1024
    assert res.reason == "killed: wall time 1 s exceeded; stdout over 8 KiB truncated"


@ROOT_ONLY
def test_process_limit_holds_for_a_bounded_burst_of_forks(scratch):
    """The harmless version first: 200 sleeping children asked for, the uid's limit stops them."""
    res = py("""
        import os, time
        n = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
            except OSError:
                break
            n += 1
        print(n, flush=True)
        time.sleep(30)
    """, scratch, Limits(wall_s=2, nproc=32))
    assert res.timed_out and 0 < int(res.stdout) < 32


@ROOT_ONLY
def test_fork_bomb_is_contained_and_swept(scratch):
    res = py("""
        import os
        print(os.getuid(), flush=True)
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, scratch, Limits(wall_s=2, nproc=32))
    uid = int(res.stdout.split()[0])
    assert res.timed_out and _live_pids(uid) == []


# --------------------------------------------------------------------------- processes that outlive


@pytest.mark.parametrize("leave_session", [False, True], ids=["same-session", "setsid-daemon"])
def test_grandchildren_die_with_the_run(scratch, leave_session):
    if leave_session and os.geteuid() != 0:
        pytest.skip("needs root: a daemon that leaves the session is found by its uid")
    res = py(f"""
        import os, time
        if os.fork() == 0:
            if {leave_session}:
                os.setsid()
            if os.fork() == 0:
                os.close(1), os.close(2)
                open("daemon.pid.tmp", "w").write(str(os.getpid()))
                os.rename("daemon.pid.tmp", "daemon.pid")
                time.sleep(60)
            os._exit(0)
        while not os.path.exists("daemon.pid"):
            time.sleep(0.01)
    """, scratch)
    daemon = int((scratch / "daemon.pid").read_text())
    assert res.ok and not alive(daemon)


def test_children_die_with_a_killed_grader(scratch):
    """A grader killed by SIGKILL cannot clean up: the kernel kills its sandboxed child instead."""
    grader = textwrap.dedent(f"""
        import os, signal, sys
        from grader.sandbox import Limits, spawn_sandboxed
        proc = spawn_sandboxed([sys.executable, "-I", "-S", "-c", "import time; time.sleep(60)"],
                               cwd={str(scratch)!r}, limits=Limits(wall_s=60))
        print(proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", grader], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    child = int(out.stdout)
    for _ in range(200):
        if not alive(child):
            break
        time.sleep(0.025)
    assert not alive(child)


def test_interactive_process_pipes_timeout_and_kill(scratch):
    code = "import sys\nfor line in sys.stdin:\n    print(line.strip().upper(), flush=True)\n"
    with spawn_sandboxed([sys.executable, "-I", "-S", "-u", "-c", code], cwd=scratch, limits=FAST) as proc:
        proc.stdin.write(b"ping\n")
        proc.stdin.flush()
        assert proc.readline(timeout=10) == b"PING\n"
        with pytest.raises(TimeoutError):
            proc.readline(timeout=0.2)
        proc.kill()
        res = proc.wait()
    assert res.killed_reason == "grader" and res.returncode < 0 and not alive(proc.pid)


def test_interactive_wait_timeout_kills(scratch):
    with spawn_sandboxed([sys.executable, "-I", "-S", "-c", "import time; time.sleep(60)"], cwd=scratch,
                         limits=FAST) as proc:
        res = proc.wait(timeout=0.5)
    assert res.timed_out and res.reason == "killed: no exit within 0.5 s"


def test_interactive_line_over_cap_is_refused(scratch):
    code = "import sys; sys.stdout.write('z' * 100000); sys.stdout.flush(); import time; time.sleep(60)"
    with spawn_sandboxed([sys.executable, "-I", "-S", "-c", code], cwd=scratch,
                         limits=Limits(wall_s=20, output_kb=4)) as proc:
        with pytest.raises(SandboxError, match="line over 4096 bytes"):
            proc.readline(timeout=10)


# --------------------------------------------------------------------------- network


def test_network_is_cut_but_private_loopback_works(scratch):
    """A listener on the grader's 127.0.0.1 is out of reach; a server inside the sandbox is not
    (multi-process gloo needs it)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
                print("host-reached")
            except OSError as err:
                print("host-blocked", type(err).__name__)
            inner = socket.create_server(("127.0.0.1", 0))
            socket.create_connection(inner.getsockname(), timeout=2).close()
            print("own-loopback-ok")
        """
        blocked = py(code, scratch)
        open_net = py(code, scratch, Limits(wall_s=20, network=True))
    if not blocked.network_isolated and os.geteuid() != 0:  # as root (CI) it must hold
        pytest.skip("this machine refuses unprivileged network namespaces (docs/SECURITY.md)")
    assert blocked.stdout.decode().split()[0] == "host-blocked"
    assert b"own-loopback-ok" in blocked.stdout
    assert open_net.stdout.split()[0] == b"host-reached"  # the same probe can tell the difference


# --------------------------------------------------------------------------- files


@ROOT_ONLY
def test_private_dirs_other_files_and_tmp_leftovers(scratch):
    kit = make_scratch()
    kit.chmod(0o755)  # like the kit checkout: readable by all, writable by root
    private = make_private(kit / "solutions")
    (private / "answer.patch").write_text("the reference fix")
    grader_file = kit / "rubric.yaml"
    grader_file.write_text("points: 10\n")
    grader_file.chmod(0o644)
    leftover = Path("/tmp", f"onenode-leftover-{os.getpid()}")
    res = py(f"""
        for what, action in [("read-private", lambda: open({str(private / 'answer.patch')!r}).read()),
                             ("list-private", lambda: __import__('os').listdir({str(private)!r})),
                             ("write-grader", lambda: open({str(grader_file)!r}, 'a').write('points: 99'))]:
            try:
                action()
                print(what, "allowed")
            except PermissionError:
                print(what, "denied")
        open({str(leftover)!r}, 'w').write('for the next submission')
    """, scratch)
    try:
        assert res.stdout.decode().split() == ["read-private", "denied", "list-private", "denied",
                                               "write-grader", "denied"]
        assert grader_file.read_text() == "points: 10\n"
        assert not leftover.exists()  # what the uid left in /tmp is gone before the next run
    finally:
        shutil.rmtree(kit)


@ROOT_ONLY
def test_one_submission_cannot_read_another_scratch(scratch):
    first = py("open('notes.txt', 'w').write('group A secret'); import os; print(os.getuid())", scratch)
    other = make_scratch()
    try:
        second = py(f"""
            try:
                print(open({str(scratch / 'notes.txt')!r}).read())
            except PermissionError:
                print("denied")
        """, other)
    finally:
        shutil.rmtree(other)
    assert first.ok and second.stdout == b"denied\n"
    info = scratch.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (0, 0o700)  # handed back to the grader


@ROOT_ONLY
def test_concurrent_runs_get_distinct_uids(scratch):
    other = make_scratch()
    code = "import os, sys; print(os.getuid(), flush=True); sys.stdin.read()"
    try:
        with spawn_sandboxed([sys.executable, "-I", "-S", "-c", code], cwd=scratch, limits=FAST) as a, \
             spawn_sandboxed([sys.executable, "-I", "-S", "-c", code], cwd=other, limits=FAST) as b:
            uids = {a.readline(timeout=10), b.readline(timeout=10)}
            for proc in (a, b):
                proc.stdin.close()
            assert a.wait(10).ok and b.wait(10).ok
    finally:
        shutil.rmtree(other)
    assert len(uids) == 2


@ROOT_ONLY
def test_unreachable_scratch_is_refused_with_a_hint(tmp_path):
    hidden = tmp_path / "private" / "scratch"
    hidden.mkdir(parents=True)
    hidden.parent.chmod(0o700)
    with pytest.raises(SandboxError, match="make_scratch"):
        run_sandboxed(["true"], cwd=hidden, limits=FAST)


def test_stdin_flood_into_a_process_that_does_not_read(scratch):
    res = py("import time; time.sleep(0.2)", scratch, stdin=bytes(8 << 20))
    assert res.ok  # the grader's writer gives up quietly instead of hanging


@ROOT_ONLY
def test_scratch_at_the_top_of_tmp_survives_the_leftover_sweep():
    scratch = Path(tempfile.mkdtemp(prefix="onenode-top-"))
    try:
        assert py("open('kept.txt', 'w').write('result')", scratch).ok
        assert (scratch / "kept.txt").read_text() == "result"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
