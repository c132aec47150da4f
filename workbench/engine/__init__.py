"""The graph engine: CUDA graphs on a GPU, a faithful emulation on the CPU, and a vLLM-like runner."""
from .api import CUDAGraph, graph, graph_pool_handle, new_graph, resolve_device, synchronize
from .host import HostDeviceMixError, HostTensor, host, is_host
from .cpu_graph import CPUGraph, ExternalRef, Pool, RecordedOp, is_capturing
from .errors import CaptureError, GraphError, IllegalMemoryAccess
from .memory import reuse_freed_blocks, track_origins

__all__ = [
    "CPUGraph", "CUDAGraph", "CaptureError", "ExternalRef", "GraphError", "HostDeviceMixError",
    "HostTensor", "IllegalMemoryAccess", "host", "is_host",
    "Pool", "RecordedOp", "graph", "graph_pool_handle", "is_capturing", "new_graph",
    "resolve_device", "reuse_freed_blocks", "synchronize", "track_origins",
]
from .graphs import CUDAGraphMode, GraphManager, validate_capture_sizes  # noqa: E402
from .runner import GraphRunner  # noqa: E402

__all__ += ["CUDAGraphMode", "GraphManager", "GraphRunner", "validate_capture_sizes"]
