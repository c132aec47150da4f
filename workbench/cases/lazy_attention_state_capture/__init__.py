"""Case 05: a lazily planned attention schedule that CUDA-graph capture never records (vLLM #42444).

FlashMLA plans its split-KV schedule on the first attention call that finds it empty. vLLM 0.20.2's
Model Runner V2 gave the warmup pass and the FULL capture of each graph size the same attention
state: the warmup planned (for the dummy capture lengths), the capture found a plan and recorded no
planner, and every replay attended with the warmup's plan whatever the real lengths were. The fix
(0.22.0) captures with a fresh state. Here a GPT-2-style LM trained on addition shows it: through
the bug's FULL graphs it loses about two thirds of its held-out accuracy, as the mechanism predicts;
the fix's graphs equal eager decoding bit for bit; PIECEWISE graphs never had the problem.

Parts: ``split_kv`` (the planner, split-KV attention and the LM), ``task`` (the addition task and
its training), ``upstream`` (the capture manager, ``bug`` and ``fix``), ``oplog`` (the kernels each
capture recorded), ``scenario`` (experiments, prediction, ``gpu_record``), ``figures``.
"""
from .. import VARIANTS
from .. import get as _get
from .figures import explore, plot_accuracy, plot_generations, plot_length_change, plot_plans
from .scenario import (BATCH_SIZE, CAPTURE_SIZES, CaseResult, Generation, LengthChange, doctor_workload,
                       generate, gpu_record, length_change, predicted_bug_accuracy, run, serve)
from .split_kv import plan_splits
from .task import (CHECKPOINT, CONFIG, EOS, PLUS, Problem, load_model, parse_answer, render, render_answer,
                   sample_problems, train, training_batch, write_checkpoint)
from .upstream import AttentionState, CudaGraphManager

CASE = _get("lazy_attention_state_capture").stem

__all__ = [
    "AttentionState", "BATCH_SIZE", "CAPTURE_SIZES", "CASE", "CHECKPOINT", "CONFIG", "CaseResult", "CudaGraphManager",
    "EOS", "Generation", "LengthChange", "PLUS", "Problem", "VARIANTS", "doctor_workload", "explore", "generate",
    "gpu_record", "length_change", "load_model", "parse_answer", "plan_splits", "plot_accuracy",
    "plot_generations", "plot_length_change", "plot_plans", "predicted_bug_accuracy", "render", "render_answer",
    "run", "sample_problems", "serve", "train", "training_batch", "write_checkpoint",
]
