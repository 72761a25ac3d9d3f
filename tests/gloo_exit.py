"""The end of a transformers reference process under torchrun, for the jobs that compare hflight with it
(tests/jobs/seq2seq_ddp_job.py)."""

import os
import sys

import torch


def exit_without_teardown() -> None:
    """End the process without the interpreter's teardown, once every rank is here. When a job's last collective
    comes right before its exit, a gloo worker thread frees that collective's work (and the all-gather before it,
    whose tensors have Python objects) after the call has returned; a thread that takes the interpreter lock while
    Python finalizes aborts the process ("terminate called without an active exception", SIGABRT; core dump:
    ``~AsyncBarrierWork`` -> ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``).
    Destroying the group first did not prevent it: 4 of 108 runs of the seq2seq job, two at a time on 2 cores (none
    of 75 with this exit). torch's issue, not what the tests compare; every result is written before the barrier."""
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
