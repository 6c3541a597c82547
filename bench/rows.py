"""
What the benchmarks share so that a time limit loses nothing: rows are printed (and files written) the moment they
are measured, and a run stopped by the suite's `timeout --signal=INT` (KeyboardInterrupt) says so and exits at once;
each row says what makes its figure suspect (CUDA graphs inductor skipped, losses that were not finite).
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


def suspect_notes(r):
    """What makes a row's figure suspect: losses that were not finite, graphs that ran without their CUDA graph."""
    out = []
    if r.get("nonfinite_losses"):
        out.append(f"loss not finite in {r['nonfinite_losses']} of {r.get('steps_run', '?')} steps")
    if r.get("cudagraph_skips"):
        out.append(f"{r['cudagraph_skips']} cudagraph skip(s)")
    return "; ".join(out)
