"""benchmarks/leased_gpu/background.sh on the CPU: a job started in its own session outlives the shell that started it (as a
device call's), `wait` reports it running (3), ended with its status (0, the status in NAME.rc) or absent (2, a
fresh machine), and a second `start` of a running job is refused."""
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/leased_gpu/background.sh"


def _bg(bg: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, "BG": str(bg)}, capture_output=True,
                          text=True, timeout=timeout)


def _own_session(pid: int) -> bool:
    """Whether pid leads its own session, given the few ms `setsid` takes after `start` has returned."""
    deadline = time.time() + 10
    while time.time() < deadline:
        if os.getsid(pid) == pid:
            return True
        time.sleep(0.05)
    return False


def test_a_job_runs_on_past_its_call_and_wait_reports_it(tmp_path):
    bg, flag = tmp_path / "bg", tmp_path / "go"
    # the job waits for a file, so "still runs" does not depend on timing; it exits 7 with a line in its log
    job = f"while [ ! -f {flag} ]; do sleep 0.1; done; echo the job ends; exit 7"
    started = _bg(bg, "start", "j", "bash", "-c", job)
    assert started.returncode == 0 and "job j started" in started.stderr  # returned at once: the job runs on
    pid = int((bg / "j.pid").read_text())
    os.kill(pid, 0)  # alive after the starting shell has exited
    assert _own_session(pid)  # in its own session: the device tool's kill of a call's group misses it

    again = _bg(bg, "start", "j", "true")
    assert again.returncode == 2 and "already runs" in again.stderr

    running = _bg(bg, "wait", "j", "1")
    assert running.returncode == 3 and "still runs" in running.stdout

    watch = tmp_path / "cell.log"
    watch.write_text("step 1\nstep 2\nstep 3\nstep 4\n")
    flag.touch()
    ended = _bg(bg, "wait", "j", "30", str(watch), str(tmp_path / "absent.log"))
    assert ended.returncode == 0, ended.stdout + ended.stderr
    assert "job j ended: exit 7" in ended.stdout and "the job ends" in ended.stdout
    assert "step 4" in ended.stdout and "step 1" not in ended.stdout  # a WATCH file's last lines only
    assert (bg / "j.rc").read_text().strip() == "7"


def test_wait_on_a_fresh_machine_says_so(tmp_path):
    r = _bg(tmp_path / "bg", "wait", "nothing", "1")
    assert r.returncode == 2 and "no job nothing" in r.stderr


def test_a_killed_job_is_reported_gone(tmp_path):
    bg = tmp_path / "bg"
    assert _bg(bg, "start", "k", "sleep", "60").returncode == 0
    pid = int((bg / "k.pid").read_text())
    assert _own_session(pid)
    os.killpg(pid, 9)  # the whole session, status file unwritten: as a machine's kill would leave it
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    r = _bg(bg, "wait", "k", "5")
    assert r.returncode == 2 and "gone without an exit status" in r.stdout
