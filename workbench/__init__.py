"""cudagraph-workbench: reproduce, explain and fix CUDA-graph failures from vLLM."""
import os

from .engine import graph, graph_pool_handle, new_graph
from .expect import expect_failure

__all__ = ["expect_failure", "graph", "graph_pool_handle", "new_graph"]
__version__ = "0.1.0"

if os.environ.get("WORKBENCH_DOCTOR", "0") != "0":
    from .doctor import start_from_environment

    start_from_environment()
