"""``run_guidellm``, the suite's bound on a GuideLLM run, with stand-in commands: a run that ends is
returned as ``subprocess.run`` would; a stalled one is killed with the processes it started and
run once more; two stalls in a row fail with what each printed."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.helpers.guidellm_runs import run_guidellm

# stalls on its first run (it leaves a marker, and a child that would outlive it), ends on its second
STALL_ONCE = """
import os, subprocess, sys, time
marker, child_pid = sys.argv[1], sys.argv[2]
if not os.path.exists(marker):
    open(marker, "w").close()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(child_pid, "w").write(str(child.pid))
    print("stalling", flush=True)
    time.sleep(60)
print("done")
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a killed child not yet reaped is a zombie
        return stat.read().split(") ")[1][0] != "Z"


def test_a_run_that_ends_is_returned_as_it_ended():
    done = run_guidellm([sys.executable, "-c", "print('report'); raise SystemExit(3)"])
    assert done.returncode == 3 and done.stdout == "report\n"


def test_a_stalled_run_is_killed_with_its_children_and_run_again(tmp_path):
    marker, child_pid = tmp_path / "ran", tmp_path / "child"
    done = run_guidellm([sys.executable, "-c", STALL_ONCE, str(marker), str(child_pid)], timeout_s=5.0)
    assert done.returncode == 0 and done.stdout == "done\n"
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the stalled run's child outlived it"


def test_two_stalls_in_a_row_fail_with_what_each_printed():
    command = [sys.executable, "-c", "print('waiting', flush=True); import time; time.sleep(60)"]
    with pytest.raises(AssertionError, match="stalled 2 times") as failure:
        run_guidellm(command, timeout_s=1.0)
    assert str(failure.value).count("waiting") == 2
