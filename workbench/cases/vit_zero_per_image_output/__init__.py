"""Case 02: ViT encoder CUDA graphs with zero tokens per image and under-sized capture buffers
(vLLM #38040).

vLLM captures Qwen3-VL's vision encoder once per token budget, each with a synthetic batch of
``max_batch_size`` images. Uncapped, that batch size gives the smallest budget zero tokens per
image and its capture crashes; a floored division leaves buffers too small for a full batch; and
with EVS pruning on, the graph path drops the 5 mrope channels the eager path appends.
"""
from .figures import plot_allocation, plot_correctness, plot_latency, plot_per_item_heatmap, plot_plan, plot_pruning
from .model import VisionConfig, VisionEncoder, build_encoder, output_tokens, to_transformers, transformers_output
from .scenario import (CASE, DEFAULTS, PRUNING, SCALED_MIN_BUDGET, TOLERANCE, UNDERSIZED, budget_range_model,
                       build_manager, doctor_workload, gpu_record, image_grid, make_pixels, mixed_stream,
                       per_item_heatmap, plan, pruning_widths, run_stream, scaled_config, try_capture,
                       underallocation)
from .upstream import (MROPE_CHANNELS, EncoderCudaGraphManager, EncoderGraphConfig, EncoderModel, check_config,
                       encode_images, generate_budgets, mrope_positions, pack_greedy, per_item_output)

__all__ = [
    "CASE", "DEFAULTS", "MROPE_CHANNELS", "PRUNING", "SCALED_MIN_BUDGET", "TOLERANCE", "UNDERSIZED",
    "EncoderCudaGraphManager", "EncoderGraphConfig", "EncoderModel", "VisionConfig", "VisionEncoder",
    "budget_range_model", "build_encoder", "build_manager", "check_config", "doctor_workload", "encode_images",
    "generate_budgets", "gpu_record", "image_grid", "make_pixels", "mixed_stream", "mrope_positions",
    "output_tokens", "pack_greedy", "per_item_heatmap", "per_item_output", "plan", "plot_allocation",
    "plot_correctness", "plot_latency", "plot_per_item_heatmap", "plot_plan", "plot_pruning", "pruning_widths",
    "run_stream", "scaled_config", "to_transformers", "transformers_output", "try_capture", "underallocation",
]
