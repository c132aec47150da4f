"""Case 03: illegal memory access at TP>1 from a gathered weight the graphs do not own (vLLM #43909).

The MTP proposer gathers the full lm_head weight once, outside its captures, and captures one
centroid top-k graph per size around it. At TP>1 that weight is an all-gather output held only by
a local variable: when setup returns it is freed, the graphs keep its address, and a replay reads
whatever took the block (silently wrong tokens) or unmapped memory (an illegal memory access).
"""
from .config import (BUG_RELEASE, BUG_REUSE, CASE, FAST, FIX, GATHER_IN_CAPTURE, GPU_RECORD, ILLEGAL_MEMORY_ACCESS,
                     STEP_WAYS, TP1_BUG, TP_SIZE, CaseResults, Scenario, ScenarioRun, Settings, settings_for)
from .figures import (plot_agreement, plot_memory_timeline, plot_step_time, plot_step_tokens, plot_token_match,
                      summary_lines)
from .scenario import (doctor_workload, eager_reference, expected_release_error, gpu_record, hidden_states,
                       load_model, record, run_case, run_tp1, serve)
from .upstream import (CENTROID_GRAPH_SIZES, CapturedWeight, CentroidsProposer, MaskedEmbedder, MTPDraftHead,
                       MTPHeadConfig, make_checkpoint, transformers_masked_embedder, weights_from_transformers)

__all__ = [
    "BUG_RELEASE", "BUG_REUSE", "CASE", "CENTROID_GRAPH_SIZES", "FAST", "FIX", "GATHER_IN_CAPTURE", "GPU_RECORD",
    "ILLEGAL_MEMORY_ACCESS", "STEP_WAYS", "TP1_BUG", "TP_SIZE", "CapturedWeight", "CaseResults",
    "CentroidsProposer", "MTPDraftHead", "MTPHeadConfig", "MaskedEmbedder", "Scenario", "ScenarioRun", "Settings",
    "doctor_workload", "eager_reference", "expected_release_error", "gpu_record", "hidden_states", "load_model",
    "make_checkpoint", "plot_agreement", "plot_memory_timeline", "plot_step_time", "plot_step_tokens",
    "plot_token_match", "record", "run_case", "run_tp1", "serve", "settings_for", "summary_lines",
    "transformers_masked_embedder", "weights_from_transformers",
]
