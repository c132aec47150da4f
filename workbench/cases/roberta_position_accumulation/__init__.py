"""Case 01: RoBERTa position ids accumulate in CUDA-graph padded slots (vLLM #37884, #37873).

vLLM 0.18.1 shifts RoBERTa's positions in place on a view of the runner's persistent buffer. Padded
slots are never refreshed, so they gain 2 at every step (startup included) until the position
embedding is indexed out of range after K requests, K predicted from the startup sequence alone.
"""
from .figures import explore, plot_buffer_row, plot_correctness, plot_index_growth, plot_positions_heatmaps
from .scenario import (CASE, MAX_POSITIONS, MODES, OFFSET, TOLERANCE, Prediction, Settings, StreamResult,
                       doctor_workload, gpu_record, graph_mode, leaves_shift, predict, predict_failing_step,
                       predict_v_init, recoveries, record_key, reproduce, run_stream, serve_stream,
                       v_init_breakdown)
from .upstream import (DummyRun, RobertaEmbeddingModel, RobertaRunner, from_transformers, startup_runs,
                       vllm_capture_sizes)

__all__ = [
    "CASE", "MAX_POSITIONS", "MODES", "OFFSET", "TOLERANCE", "DummyRun", "Prediction", "RobertaEmbeddingModel",
    "RobertaRunner", "Settings", "StreamResult", "doctor_workload", "explore", "from_transformers",
    "gpu_record", "graph_mode", "leaves_shift", "plot_buffer_row", "plot_correctness", "plot_index_growth",
    "plot_positions_heatmaps", "predict", "predict_failing_step", "predict_v_init", "recoveries",
    "record_key", "reproduce", "run_stream", "serve_stream", "startup_runs", "v_init_breakdown",
    "vllm_capture_sizes",
]
