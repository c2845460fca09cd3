"""Which exceptions a step may survive, and how a request that failed in one is described.

A step survives an exception by failing the requests it involves (``LLMEngine.step``); an
exception after which the process itself cannot be trusted is fatal and propagates, and the
worker exits (its launcher restarts it).
"""

from __future__ import annotations

import sys

MAX_MESSAGE_CHARS = 300  # of the exception's own text, in the message a client sees
# Exit status of a worker process that stopped on a fatal error (sysexits' EX_SOFTWARE).
EXIT_FATAL = 70


def is_fatal(exc: BaseException) -> bool:
    """Out of host or device memory, a device error, or not an ``Exception`` at all
    (KeyboardInterrupt, SystemExit): the process must end rather than go on serving."""
    if not isinstance(exc, Exception):
        return True
    if isinstance(exc, MemoryError):
        return True
    # torch's own errors, if torch is loaded (no module of this process raised one otherwise):
    # importing it here would cost the commands that never use it (simulate, plan) two seconds.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, (torch.OutOfMemoryError, torch.AcceleratorError,
                                              torch.cuda.CudaError)):
        return True
    # Older code paths report a CUDA failure as a plain RuntimeError; the context is unusable.
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


def describe(exc: BaseException, stage: str) -> str:
    """The message a request's client gets: where it failed and the exception, one line."""
    text = " ".join(str(exc).split())[:MAX_MESSAGE_CHARS]
    return f"internal error while {stage}: {type(exc).__name__}" + (f": {text}" if text else "")
