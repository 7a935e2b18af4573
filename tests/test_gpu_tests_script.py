"""benchmarks/leased_gpu/gpu_tests.sh, run on the CPU against a made-up GPU-marked test file: a TERM from an outer limit
reaches pytest as INT, so the tests that ran and pytest's summary and JUnit file are still written (a
`timeout 300 bash gpu_tests.sh` had lost all three)."""
import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SLOW = '''
import time
import pytest

@pytest.mark.gpu
def test_a_fast_one():
    pass

@pytest.mark.gpu
def test_a_slow_one():
    time.sleep(120)
'''


def test_a_term_to_the_script_still_gets_pytests_summary(tmp_path):
    (tmp_path / "test_made_up.py").write_text(SLOW)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "LIMIT": "300"}
    p = subprocess.Popen(["bash", str(ROOT / "benchmarks/leased_gpu/gpu_tests.sh"), str(tmp_path / "test_made_up.py")],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = out / "gpu_tests.log"
    t0 = time.time()
    while not (log.is_file() and "test_a_fast_one PASSED" in log.read_text()):  # the fast test has passed
        assert time.time() - t0 < 60 and p.poll() is None, log.read_text() if log.is_file() else "no log"
        time.sleep(0.2)
    time.sleep(0.5)  # into the slow one
    p.send_signal(signal.SIGTERM)  # as `timeout N bash gpu_tests.sh` does at N
    printed, _ = p.communicate(timeout=60)
    assert time.time() - t0 < 60  # stopped at once, not after the slow test's 120 s
    text = log.read_text()
    assert "1 passed" in text and "KeyboardInterrupt" in text, text
    assert (out / "gpu_tests.xml").is_file()
    assert "== pytest -m gpu exited 2" in printed and p.returncode == 2
    # the tests it did not reach, by node id, ready for the next call (the one cut in the middle among them)
    assert (out / "gpu_tests_not_run.txt").read_text() == "test_made_up.py::test_a_slow_one\n"
    assert "== not reached (1)" in printed and "gpu_tests.sh 'test_made_up.py::test_a_slow_one'" in printed
