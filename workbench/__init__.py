"""cudagraph-workbench: reproduce, explain and fix CUDA-graph failures from vLLM."""
from .engine import graph, graph_pool_handle, new_graph
from .expect import expect_failure

__all__ = ["expect_failure", "graph", "graph_pool_handle", "new_graph"]
__version__ = "0.1.0"
