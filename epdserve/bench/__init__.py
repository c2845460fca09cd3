"""``epdserve bench``: load generation and measurement against any OpenAI-compatible server.

Metric definitions and result key names follow vLLM's ``vllm bench serve`` so that results
from the two tools can be compared directly.
"""

from epdserve.errors import EpdserveError


class BenchError(EpdserveError):
    """A benchmark cannot run: bad arguments, unreadable dataset, unreachable server.

    The message is one line meant for stderr; ``run_bench_serve`` turns it into a nonzero exit.
    """
