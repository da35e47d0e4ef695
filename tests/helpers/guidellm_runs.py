"""GuideLLM's ``run`` as the suite drives it: a bounded wait, and one more attempt after a stall.

GuideLLM can stall for good once its benchmark's constraint is reached, its worker processes
waiting on one another with no request in flight (reported on GuideLLM's tracker for 0.3 and 0.7:
"Possible hang/deadlock in-between a rate change", "Ensure requests are forcefully killed a
certain amount of time after benchmark completes"). Seen here once with 0.8.1 on a loaded 2-core machine:
the two-second run's requests all served, the server idle with no connection open, the client's
workers on a futex until the test's 10-minute timeout. A stall is the client's, not the server's,
so it is killed with its workers and run once more; two stalls in a row fail the test with what
each printed.
"""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["run_guidellm"]


def run_guidellm(command: list[str], *, timeout_s: float = 180.0, attempts: int = 2) -> subprocess.CompletedProcess:
    """``command`` (a ``guidellm run``) to its end, each attempt at most ``timeout_s`` (a normal
    run of the suite's takes 10-20 s); its output as ``subprocess.run`` gives it. It runs offline:
    the suite's tokenizers are local directories."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    stalls = []
    for _ in range(attempts):
        # a session of its own, so that a stalled run's worker processes go with it
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                   start_new_session=True)
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # the whole group ended just as the wait ran out
                pass
            out, err = process.communicate()
            if process.returncode == -signal.SIGKILL:
                stalls.append(f"--- stalled after {timeout_s:.0f} s ---\n{err[-1500:]}\n{out[-1500:]}")
                continue
        return subprocess.CompletedProcess(command, process.returncode, out, err)
    raise AssertionError(f"GuideLLM stalled {attempts} times in a row:\n" + "\n".join(stalls))
