"""Whether torch.compile is tracing the code that asks, in this thread.

`torch.compiler.is_compiling()` reads one flag of the whole process, held set while any thread compiles. A
server's warm-up compiles the code predictor in a background thread while the engine thread serves eagerly, and
the engine thread's ops then took the branches meant for traced code: other kernels and other sums (a request's
bits depended on whether a compile ran meanwhile), and a streamed codec transformer, whose matrices are held as
their row-kernel packs alone, had no branch to take and failed every decode during the compile. `is_compiling`
is True only where dynamo traces this very thread: torch's tracing context is the thread's own, and dynamo bakes
the check's result into the graph it traces (`torch.compiler.assume_constant_result`), so a compiled graph does not
look again.

    if is_compiling():                    # instead of torch.compiler.is_compiling()
        ...                               # what traced code runs
"""

from __future__ import annotations

import torch


@torch.compiler.assume_constant_result
def _traced_in_this_thread() -> bool:
    return torch._guards.TracingContext.try_get() is not None


def is_compiling() -> bool:
    """torch.compiler.is_compiling(), for this thread only: False in a thread that runs eagerly while another
    compiles."""
    return torch.compiler.is_compiling() and _traced_in_this_thread()
