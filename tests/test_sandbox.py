"""The sandbox against hostile snippets: each test runs a few lines of Python through run_sandboxed
or spawn_sandboxed and checks the limit held and the grader's side (files, processes) is intact.

CI runs as root with bubblewrap installed (`make system-deps`), where every guarantee of
docs/SECURITY.md holds; the tests that need a uid of the sandbox's own, or bubblewrap, are skipped
elsewhere with the reason (the fork bomb never runs without RLIMIT_NPROC on a dedicated uid).
Processes inside the sandbox have pids of its own pid namespace: the tests take host pids from the
grader's side, `SandboxedProcess.pids()`.
"""

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from grader import sandbox
from grader.sandbox import (
    UNSAFE_ENV,
    Limits,
    SandboxError,
    _live_pids,
    capabilities,
    make_private,
    make_scratch,
    run_sandboxed,
    sandbox_env,
    spawn_sandboxed,
)

KIT = Path(__file__).resolve().parents[1]
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: uid isolation (see docs/SECURITY.md)")
SANDBOXED = pytest.mark.skipif(not capabilities()["filesystem_isolated"],
                               reason=f"no sandbox here: {capabilities()['sandbox_problem']}")
FAST = Limits(wall_s=20, cpu_s=20, memory_mb=512, nproc=64, output_kb=64)
TORCH = Limits(wall_s=120, cpu_s=120, memory_mb=None, nproc=256, output_kb=64)


@pytest.fixture
def scratch():
    path = make_scratch()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def py(code: str, scratch: Path, limits: Limits = FAST, **kw):
    """Run a Python snippet (no site-packages: fast start) in the sandbox."""
    return run_sandboxed([sys.executable, "-I", "-S", "-c", textwrap.dedent(code)], cwd=scratch,
                         limits=limits, **kw)


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (state, ppid, ...); empty once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return bool(fields) and fields[0] not in "ZX"


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime of ``pids``, in clock ticks, as the kernel counts them."""
    return sum(int(f[11]) + int(f[12]) for f in map(stat_fields, pids) if f)


def spawn_py(code: str, scratch: Path, limits: Limits = FAST, **kw):
    return spawn_sandboxed([sys.executable, "-I", "-S", "-u", "-c", textwrap.dedent(code)], cwd=scratch,
                           limits=limits, **kw)


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
    assert "ONENODE_GRADER_SECRET" not in env and set(env) - {"PWD"} == set(sandbox_env(scratch))
    assert env.get("PWD", str(scratch.resolve())) == str(scratch.resolve())  # bwrap names the cwd
    for key in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "HF_HOME", "PYTHONPATH"):
        assert Path(env[key]).is_relative_to(scratch.resolve()), key
    assert env["PYTHONPATH"] == str(scratch.resolve() / "starter_code")


@SANDBOXED
@pytest.mark.parametrize("allowed", [False, True])
def test_user_namespaces_stay_closed_unless_the_child_closes_its_own(scratch, allowed):
    """A child may create no user namespace (it could hide processes and traffic there), unless
    `Limits.user_namespaces` says its processes close their own (the A1 ranks: grader/a1/confine.py)."""
    res = run_sandboxed(["unshare", "--user", "true"], cwd=scratch,
                        limits=dataclasses.replace(FAST, user_namespaces=allowed))
    assert (res.returncode == 0) == (allowed and sandbox._user_namespaces_closable()), res.stderr


@ROOT_ONLY
def test_runs_as_unprivileged_uid_without_new_privileges(scratch):
    res = py("""
        import os
        print(os.getuid(), os.getgid(), os.getgroups())
        status = dict(l.split(':', 1) for l in open('/proc/self/status'))
        print(status['NoNewPrivs'].strip(), *(int(status[c], 16) for c in ('CapPrm', 'CapEff', 'CapBnd', 'CapAmb')))
    """, scratch)
    ids, privileges = res.stdout.decode().splitlines()
    uid = int(ids.split()[0])
    assert uid != 0 and ids == f"{uid} {uid} []" and privileges == "1 0 0 0 0"


@ROOT_ONLY
def test_the_leased_uid_has_a_user_name_for_compiler_caches(scratch):
    """The leased uid has no passwd entry; torch.compile names its caches after getpass.getuser(),
    which failed there (a GPU grading job's starter sessions stopped on it)."""
    res = py("import getpass, os; print(os.getuid(), getpass.getuser())", scratch)
    uid, name = res.stdout.decode().split()
    assert int(uid) != 0 and name == "onenode-sandbox"


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


def host_pid(namespace_pid: int, among: list[int]) -> int:
    """The host pid of the process that is ``namespace_pid`` inside the sandbox (NSpid's last field)."""
    for pid in among:
        nspids = [line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("NSpid:")][0]
        if int(nspids[-1]) == namespace_pid:
            return pid
    raise AssertionError(f"no process {namespace_pid} in the sandbox: {among}")


@pytest.mark.parametrize("leave_session", [False, True], ids=["same-session", "setsid-daemon"])
def test_grandchildren_die_with_the_run(scratch, leave_session):
    if leave_session and os.geteuid() != 0 and not capabilities()["pid_namespace"]:
        pytest.skip("needs root or bubblewrap: a daemon that leaves the session is found by its uid or pid namespace")
    code = f"""
        import os, sys, time
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
        print("daemon started", flush=True)
        sys.stdin.read()
    """
    with spawn_py(code, scratch) as proc:
        assert proc.readline(timeout=10) == b"daemon started\n"
        daemon = host_pid(int((scratch / "daemon.pid").read_text()), proc.pids())
        assert alive(daemon)
        proc.stdin.close()
        res = proc.wait(10)
    assert res.ok and not alive(daemon) and proc.pids() == []


def test_children_die_with_a_killed_grader(scratch):
    """A grader killed by SIGKILL cannot clean up: the kernel kills its sandboxed child instead."""
    grader = textwrap.dedent(f"""
        import json, os, signal, sys
        from grader.sandbox import Limits, spawn_sandboxed
        proc = spawn_sandboxed([sys.executable, "-I", "-S", "-u", "-c", "import time; print(1); time.sleep(60)"],
                               cwd={str(scratch)!r}, limits=Limits(wall_s=60))
        proc.readline(timeout=30)
        print(json.dumps([proc.pid] + proc.pids()), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", grader], capture_output=True, text=True, timeout=60,
                         cwd=KIT)
    children = json.loads(out.stdout)
    assert len(children) >= 2, out.stderr
    for _ in range(200):
        if not any(map(alive, children)):
            break
        time.sleep(0.025)
    assert not any(map(alive, children))


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


@SANDBOXED
def test_private_dirs_other_files_and_tmp_leftovers(scratch):
    """Outside its scratch copy the child finds nothing of the kit, private or world-readable."""
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
                             ("read-grader", lambda: open({str(grader_file)!r}).read()),
                             ("write-grader", lambda: open({str(grader_file)!r}, 'a').write('points: 99'))]:
            try:
                action()
                print(what, "allowed")
            except OSError as err:
                print(what, type(err).__name__)
        open({str(leftover)!r}, 'w').write('for the next submission')
    """, scratch)
    try:
        assert res.stdout.decode().split() == ["read-private", "FileNotFoundError", "list-private",
                                               "FileNotFoundError", "read-grader", "FileNotFoundError",
                                               "write-grader", "FileNotFoundError"]
        assert grader_file.read_text() == "points: 10\n"
        assert res.ok and not leftover.exists()  # /tmp is the sandbox's own: nothing lands in the host's
    finally:
        shutil.rmtree(kit)


@SANDBOXED
def test_one_submission_cannot_read_another_scratch(scratch):
    first = py("open('notes.txt', 'w').write('group A secret'); import os; print(os.getuid())", scratch)
    other = make_scratch()
    try:
        second = py(f"""
            import os
            mine = [os.path.basename(os.getcwd())]
            print(os.path.exists({str(scratch)!r}), os.listdir({str(scratch.parent)!r}) == mine)
        """, other)
    finally:
        shutil.rmtree(other)
    assert first.ok and second.stdout == b"False True\n"  # not even the other scratch's name
    if os.geteuid() == 0:
        info = scratch.stat()
        assert (info.st_uid, info.st_mode & 0o777) == (0, 0o700)  # handed back to the grader


@SANDBOXED
def test_only_the_scratch_and_the_python_install_are_visible(scratch):
    """The red team's walk over the file system (issue 17), as a unit: a world-readable folder
    elsewhere, the kit this test runs from, the checkout the venv lives in and the source its
    editable install points to are all absent; only the scratch copy is writable."""
    cohort = Path(tempfile.mkdtemp(prefix="onenode-cohort-"))
    try:
        cohort.chmod(0o755)
        (cohort / "other-group").mkdir(mode=0o755)
        (cohort / "other-group" / "submission.patch").write_text("other group's work")
        (cohort / "other-group" / "submission.patch").chmod(0o644)
        prefixes = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)})
        res = py(f"""
            import os, json
            allowed = ("/usr/", "/etc/", {str(scratch) + "/"!r}, *{[p + "/" for p in prefixes]!r})
            stray = []
            for top, dirs, files in os.walk("/"):
                dirs[:] = [d for d in dirs if os.path.join(top, d) not in ("/proc", "/sys", "/dev", "/usr")]
                stray += [os.path.join(top, f) for f in files if not os.path.join(top, f).startswith(allowed)]
            gone = {{p: os.path.exists(p) for p in {[str(cohort), str(KIT / "README.md"), str(KIT / "grader"),
                                                      str(KIT / "solutions"), str(KIT / "starter_code" / "onenode"),
                                                      str(Path(sys.prefix).parent / "solutions")]!r}}}
            kit = sorted(os.listdir({str(KIT)!r})) if os.path.isdir({str(KIT)!r}) else []
            writable = {{p: os.access(p, os.W_OK) for p in [os.getcwd(), {prefixes[0]!r}, "/usr/bin"]}}
            print(json.dumps([stray, gone, writable, kit]))
        """, scratch, Limits(wall_s=60, cpu_s=60, memory_mb=512, output_kb=256))
    finally:
        shutil.rmtree(cohort)
    stray, gone, writable, kit = json.loads(res.stdout)
    assert stray == [] and not any(gone.values()), (stray, gone)
    # A venv inside the checkout (CI's .venv) is mounted at its own path, so the checkout's folder
    # exists as the mount's parent: it may show the way to the venv, nothing else.
    venv_parts = {Path(p).relative_to(KIT).parts[0] for p in prefixes if Path(p).is_relative_to(KIT)}
    assert set(kit) <= venv_parts, kit
    assert writable == {str(scratch): True, prefixes[0]: False, "/usr/bin": False}


@SANDBOXED
def test_scratch_below_a_private_dir_runs_and_its_neighbours_stay_hidden(tmp_path):
    hidden = tmp_path / "private" / "scratch"
    hidden.mkdir(parents=True)
    hidden.parent.chmod(0o700)
    (hidden.parent / "neighbour.txt").write_text("not yours")
    res = py("import os; print(os.listdir('..'))", hidden)
    assert res.ok and res.stdout == b"['scratch']\n"


@SANDBOXED
def test_readable_paths_are_seen_read_only(scratch, tmp_path):
    cache = tmp_path / "hf-cache"
    cache.mkdir(mode=0o777)
    (cache / "model.txt").write_text("weights")
    (cache / "model.txt").chmod(0o666)  # writable by all: only the read-only mount stops the child
    res = py(f"""
        print(open({str(cache / 'model.txt')!r}).read())
        try:
            open({str(cache / 'model.txt')!r}, 'a').write('poisoned')
        except OSError as err:
            print(type(err).__name__, err.errno)
    """, scratch, readable=[cache])
    assert res.stdout.decode().split() == ["weights", "OSError", "30"]  # EROFS
    with pytest.raises(SandboxError, match="does not exist"):
        py("pass", scratch, readable=[tmp_path / "missing"])


def test_cwd_outside_the_scratch_is_refused(scratch, tmp_path):
    with pytest.raises(SandboxError, match="outside the scratch"):
        run_sandboxed(["true"], cwd=tmp_path, scratch=scratch, limits=FAST)


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


def test_stdin_flood_into_a_process_that_does_not_read(scratch):
    res = py("import time; time.sleep(0.2)", scratch, stdin=bytes(8 << 20))
    assert res.ok  # the grader's writer gives up quietly instead of hanging


def test_scratch_at_the_top_of_tmp_is_the_real_one():
    """The sandbox's /tmp is its own: a scratch copy made there is bound over it, so writes land."""
    scratch = Path(tempfile.mkdtemp(prefix="onenode-top-"))
    try:
        assert py("open('kept.txt', 'w').write('result')", scratch).ok
        assert (scratch / "kept.txt").read_text() == "result"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------- without bubblewrap


@pytest.fixture
def no_bubblewrap(monkeypatch):
    """This machine as if bubblewrap were not installed (the probe is cached: redone on both sides)."""
    monkeypatch.setattr(sandbox, "BWRAP", "onenode-no-such-bwrap")
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    for probe in (sandbox._sandbox_problem, sandbox._warn_about_gaps):
        probe.cache_clear()
    yield
    for probe in (sandbox._sandbox_problem, sandbox._warn_about_gaps):
        probe.cache_clear()


def test_without_bubblewrap_submissions_do_not_run(scratch, no_bubblewrap):
    with pytest.raises(SandboxError) as refused:
        py("open('ran', 'w').write('yes')", scratch)
    assert "apt-get install bubblewrap" in str(refused.value) and "\n" not in str(refused.value)
    assert UNSAFE_ENV in str(refused.value) and not (scratch / "ran").exists()
    assert capabilities()["filesystem_isolated"] is False


def test_the_unsafe_escape_hatch_runs_unsandboxed_and_says_so(scratch, no_bubblewrap, monkeypatch):
    monkeypatch.setenv(UNSAFE_ENV, "1")
    with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
        res = py("import os; print(os.path.isdir('/proc/1'), os.getuid())", scratch)
    assert res.ok and not res.filesystem_isolated and not res.network_isolated
    assert res.stdout.split()[0] == b"True"  # the host's processes are in sight: no pid namespace
    if os.geteuid() == 0:
        assert int(res.stdout.split()[1]) != 0  # the leased uid still holds


# --------------------------------------------------------------------------- evidence from outside


def test_death_by_signal_reads_as_such(scratch):
    res = py("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", scratch)
    assert (res.returncode, res.killed_reason, res.reason) == (-11, "signal", "killed by SIGSEGV")


def test_pause_freezes_every_process_and_resume_lets_them_run(scratch):
    """A frozen child uses no CPU (so the grader can time another one alone), forked ones included."""
    code = """
        import os
        if os.fork():  # two busy processes
            print("spinning", flush=True)
        while True:
            pass
    """
    with spawn_py(code, scratch, Limits(wall_s=30, cpu_s=30)) as proc:
        assert proc.readline(timeout=10) == b"spinning\n"
        time.sleep(0.2)
        busy = [pid for pid in proc.pids() if stat_fields(pid)[0] == "R"] or proc.pids()
        proc.pause()
        assert all(stat_fields(pid)[0] in "tT" for pid in proc.pids())
        frozen = cpu_ticks(busy)
        time.sleep(0.5)
        assert cpu_ticks(busy) == frozen
        proc.resume()
        time.sleep(0.5)
        assert cpu_ticks(busy) > frozen
    assert len(busy) >= 2



def test_resume_says_when_a_frozen_process_ran_all_the_same(scratch):
    """A stop is a state a signal undoes (a timer's SIGCONT): `resume` reads the frozen tree's CPU
    time again and says in one line that a process ran; an honest frozen tree reads None. Fails if
    `pause` only checks that every process stopped once."""
    code = """
        import os
        if os.fork():
            print("spinning", flush=True)
        while True:
            pass
    """
    with spawn_py(code, scratch, Limits(wall_s=30, cpu_s=30)) as proc:
        assert proc.readline(timeout=10) == b"spinning\n"
        proc.pause()
        time.sleep(0.2)
        assert proc.resume() is None  # frozen throughout
        proc.pause()
        woken = max(proc.pids())
        os.kill(woken, signal.SIGCONT)  # what a timer the child set up would send
        time.sleep(0.2)
        ran = proc.resume()
    assert ran is not None and "while the sandbox was frozen" in ran and "\n" not in ran


def test_resume_says_when_a_frozen_process_woke_and_ended_before_it_looked(scratch):
    """The red team's second burner: woken by its timer, it burns and exits, reaped by the kernel
    (its parent ignores SIGCHLD), so neither its CPU time nor a new pid is left at `resume`. A
    stopped process cannot end on its own, so one that is gone says it ran."""
    code = """
        import os, signal
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
        if os.fork() == 0:
            signal.signal(signal.SIGCONT, lambda *_: os._exit(0))  # woken: burn, then leave no trace
            print("burner", os.getpid(), flush=True)
            while True:
                pass
        signal.pause()
    """
    with spawn_py(code, scratch, Limits(wall_s=30, cpu_s=30)) as proc:
        assert proc.readline(timeout=10).startswith(b"burner")
        proc.pause()
        burner = max(proc.pids())
        os.kill(burner, signal.SIGCONT)
        time.sleep(0.2)
        assert burner not in proc.pids()
        ran = proc.resume()
    assert ran == f"process {burner} ended while the sandbox was frozen"

def test_peak_memory_is_read_from_proc(scratch):
    code = """
        import sys
        block = b"x" * (200 << 20)
        del block
        print("freed", flush=True)
        sys.stdin.read()
    """
    with spawn_py(code, scratch) as proc:
        assert proc.readline(timeout=10) == b"freed\n"
        peaks = proc.peak_memory_bytes()
        proc.stdin.close()
        assert proc.wait(10).ok
    assert set(peaks) <= set(proc._pids) and max(m.rss for m in peaks.values()) >= 200 << 20
    on_gpu = shutil.which("nvidia-smi") is not None
    assert all((m.gpu is not None) == on_gpu for m in peaks.values())


GLOO = """
import os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(r: int) -> None:
    dist.init_process_group("gloo", init_method="file://" + os.path.abspath("store"), rank=r, world_size=2)
    tensor = torch.ones(int(sys.argv[1]))
    dist.all_reduce(tensor)
    assert tensor[0].item() == 2
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank, nprocs=2)
    print("reduced", flush=True)
    sys.stdin.read()
"""


@SANDBOXED
def test_network_bytes_count_gloo_traffic_inside_and_nothing_else(scratch):
    """Two gloo ranks all-reduce 4 MiB over the sandbox's loopback: the grader's counter, read
    from /proc, grows by at least that much; a child that does nothing moves nothing."""
    (scratch / "gloo.py").write_text(GLOO)
    numel = 1 << 20
    with spawn_sandboxed([sys.executable, "gloo.py", str(numel)], cwd=scratch, limits=TORCH,
                         env={"GLOO_SOCKET_IFNAME": "lo"}) as proc:
        assert proc.network_bytes() == 0
        assert proc.readline(timeout=110) == b"reduced\n", proc.wait(1).stderr[-2000:]
        moved = proc.network_bytes()
        proc.stdin.close()
        assert proc.wait(10).ok
    assert moved >= 4 * numel
    with spawn_py("import sys; print('idle', flush=True); sys.stdin.read()", scratch) as idle:
        idle.readline(timeout=10)
        time.sleep(0.3)
        assert idle.network_bytes() < 1024
    with spawn_py("print(1)", scratch, Limits(wall_s=20, network=True)) as shared:
        assert shared.network_bytes() is None  # the machine's counters are not the child's


def test_gpu_devices_are_bound_only_on_gpu_machines(monkeypatch):
    """What a GPU machine adds to the child's /dev and /sys (no GPU here: the arguments only)."""
    tree = sandbox._Tree()
    tree.devices_and_temp(None)
    assert not any(arg.startswith("/dev/nvidia") for arg in tree.args) or os.path.exists("/dev/nvidia0")
    monkeypatch.setattr(sandbox, "_gpu_machine", lambda: True)
    monkeypatch.setattr(sandbox.glob, "glob", lambda pattern: ["/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidiactl"])
    tree = sandbox._Tree()
    tree.devices_and_temp(None)
    text = " ".join(tree.args)
    for device in ("/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidiactl"):
        assert f"--dev-bind {device} {device}" in text
    assert "--ro-bind /sys /sys" in text and text.index("--dev /dev") < text.index("--dev-bind")


@SANDBOXED
def test_a_bwrap_the_sandbox_cannot_see_is_refused_in_one_line(tmp_path, monkeypatch):
    """The child runs bwrap again inside the sandbox, whose /tmp is its own: a bwrap unpacked under
    /tmp works for the grader and fails in every session. The probe says so before any runs."""
    from grader import sandbox

    hidden = Path(tempfile.mkdtemp(dir="/tmp")) / "bwrap"
    shutil.copy2(shutil.which("bwrap"), hidden)
    which = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: str(hidden) if name == sandbox.BWRAP else which(name))
    problem = sandbox._sandbox_problem.__wrapped__()
    shutil.rmtree(hidden.parent)
    monkeypatch.undo()
    assert problem is not None and f"{hidden} is not visible inside the sandbox" in problem
    assert sandbox._sandbox_problem.__wrapped__() is None  # the system's bwrap: nothing to say
