"""
What the benchmarks share so that a time limit loses nothing: rows are printed (and files written) the moment they
are measured, and a run stopped by the suite's `timeout --signal=INT` (KeyboardInterrupt) says so and exits at once.
"""

import os
import sys


def emit(*lines):
    """Print now, flushed: a time limit may stop the run at any moment after this."""
    for line in lines:
        print(line, flush=True)


def exit_now(code=130):
    """Exit at once after a KeyboardInterrupt, everything already printed and written: a normal exit can wait on
    inductor's compile workers (stopped mid-compile by the same signal) until `timeout` kills the process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cudagraph_skips():
    """Inductor's count of graphs it ran without their CUDA graph ("skipping cudagraphs due to ..." in its log)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]
