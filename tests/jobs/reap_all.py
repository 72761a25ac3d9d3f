"""Run a command in a session of its own and record the exit code of every process of it that ends up reaped here.

    python tests/jobs/reap_all.py RESULT.json TIMEOUT -- COMMAND...

This process becomes the "child subreaper" of what it runs (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): a process whose
parent exited first is handed to it, so the exit status of every launched rank is seen, whoever its parent was.
Prints ``job PID`` first (the session's leader, for signalling its process group). After TIMEOUT seconds the whole
session is killed. RESULT.json maps each reaped pid to its exit code (negative: the signal that killed it).
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    result, timeout, command = sys.argv[1], float(sys.argv[2]), sys.argv[4:]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    job = subprocess.Popen(command, start_new_session=True)
    print(f"job {job.pid}", flush=True)
    timer = threading.Timer(timeout, lambda: os.killpg(job.pid, signal.SIGKILL))
    timer.start()
    codes = {}
    try:
        while True:
            pid, status = os.wait()
            codes[pid] = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        pass
    finally:
        timer.cancel()
    with open(result, "w") as f:
        json.dump(codes, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
