"""`LocalServer.stop` on a crashed server: the server process is gone, a process it left in its
group ignores SIGTERM (as multiprocessing's resource tracker does). stop() must not wait out
its whole deadline for the orphan: a short grace (ORPHAN_GRACE_S), then SIGKILL. Measured on a
virtual clock (time.monotonic / time.sleep patched), so the load of the machine cannot matter."""
import os
import signal
import subprocess
import time

from megarl.rollout.engines import servers
from megarl.rollout.engines.servers import ORPHAN_GRACE_S, LocalServer


def test_stop_kills_what_a_dead_server_left_after_a_short_grace(tmp_path, monkeypatch):
    pid_file = tmp_path / "orphan.pid"
    # the leader starts a child that ignores SIGTERM, writes its pid, and exits (a crashed server)
    script = f"sh -c 'trap \"\" TERM; echo $$ > {pid_file}; exec sleep 300' & wait_for=$!; " \
             f"while [ ! -s {pid_file} ]; do sleep 0.05; done"
    server = LocalServer(tmp_path, tmp_path / "log", api_key="k")
    server.proc = subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True)
    server.proc.wait(timeout=60)
    orphan = int(pid_file.read_text())
    os.kill(orphan, 0)   # alive, in the dead leader's group

    now = [1000.0]
    monkeypatch.setattr(servers.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(servers.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    server.stop(timeout_s=15.0)
    waited = now[0] - 1000.0
    assert waited <= ORPHAN_GRACE_S + 0.2, f"stop() waited {waited:.1f} virtual s for an orphan (deadline 15)"
    # the real clock again: the patch is on the shared `time` module, so the poll below would
    # not sleep, and a loaded machine may take longer than 100 bare polls to deliver the kill
    monkeypatch.undo()
    for _ in range(100):   # SIGKILL sent; the kernel reaps it (init adopts it) momentarily
        try:
            os.kill(orphan, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{orphan}/stat") as f:
            if f.read().split(") ")[1][0] in "ZX":
                break
        time.sleep(0.05)
    else:
        os.kill(orphan, signal.SIGKILL)
        raise AssertionError("the orphan survived stop()")


class SleepServer(LocalServer):
    """start() exactly as for vLLM, with a command that only sleeps."""

    def command(self):
        return ["/bin/sh", "-c", "sleep 120 & wait"]


def test_a_server_is_a_process_group_of_its_own_in_the_callers_session(tmp_path):
    """Where the kernel groups scheduling by session, a server in a session of its own waited
    seconds behind its own engine threads to stream (bench/stream_gaps.py): the server stays in
    the caller's session, in a process group of its own that stop() signals as a whole."""
    server = SleepServer(tmp_path, tmp_path / "log", api_key="k")
    server.start()
    try:
        pid = server.proc.pid
        assert os.getsid(pid) == os.getsid(0), "the server has a session of its own"
        assert os.getpgid(pid) == pid != os.getpgid(0), "the server is not the leader of its own group"
    finally:
        server.stop(timeout_s=10)
    assert server.proc.poll() is not None
    assert not servers._group_alive(pid)
