"""One rank of the exit test (tests/test_bad_input_launch.py). Rank 0 leaves a gloo all-gather that
rank 1 joins a second later; gloo's worker thread then releases the work, whose tensors' Python
objects it must free under the GIL, while rank 0's main thread holds the GIL into the interpreter's
teardown (the run's last Python steps; the switch interval is raised so that this is certain instead
of a matter of milliseconds). A thread that takes the GIL once the teardown has begun is ended inside
a C++ destructor: "terminate called without an active exception", SIGABRT, a finished 2-rank run
reported failed (the CI failure of stop 36). `return`: rank 0 ends as a Python program does;
`end_rank`: through headstart.launch.end_rank, which runs the exit handlers and skips the teardown."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from headstart.launch import end_rank


class _Teardown:
    def __del__(self):
        time.sleep(1.0)  # the teardown lets go of the GIL (as any finaliser that waits on I/O does)


def main() -> None:
    how = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    out, mine = [torch.empty(1), torch.empty(1)], torch.ones(1)
    for t in (*out, mine):
        t.tag = "Python state"  # kept in the tensor's Python object, which C++ owns once Python lets go
    if dist.get_rank() == 1:
        time.sleep(1.0)
        dist.all_gather(out, mine)
        os._exit(0)
    sys.setswitchinterval(60.0)  # the main thread keeps the GIL until it blocks (or the teardown sleeps)
    dist.all_gather(out, mine, async_op=True)  # the work's handle is dropped: gloo's thread holds the last one
    del out, mine
    sys.modules["__main__"].__dict__["_teardown"] = _Teardown()
    end = time.monotonic() + 3.0
    while time.monotonic() < end:  # the run's last Python steps, holding the GIL while rank 1 joins
        pass
    if how == "end_rank":
        end_rank(0)


if __name__ == "__main__":
    main()
