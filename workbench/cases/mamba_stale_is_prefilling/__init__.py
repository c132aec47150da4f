"""Case 04: a stale ``is_prefilling`` in padded rows makes Mamba requests read each other's state.

vLLM #41873 / #42947 (issue #41841). Under FULL CUDA graphs a pure-decode batch of ``n`` requests
runs the graph captured for ``size >= n`` rows. ``_build_attention_metadata`` computes
``is_prefilling = num_computed < num_prompt`` over all ``size`` rows, and rows ``>= n`` still hold
the counters ``condense()`` left behind. If a request was moved out of such a row mid chunked
prefill, the padded row reads ``True`` and becomes a zero-length "prefill"; the Mamba builder sees
``num_prefills > 0`` and skips refreshing the persistent state-index buffer; the FULL graph (already
chosen) replays with the previous pure-decode step's slots. Requests then read and write other
requests' recurrent state: no error, different tokens.

Parts: ``mamba`` (the tiny Mamba LM), ``upstream`` (vLLM's persistent batch and Mamba metadata,
``bug`` / ``fix`` / ``guard``), ``runner`` (scheduler and ``MambaServer`` on the engine's graph
manager), ``scenario`` (the served workload, unit cases, ``gpu_record``), ``figures``.
"""
from .. import get as _get
from .figures import plot_is_prefilling, plot_state_slots, plot_token_agreement, prefill_matrix
from .mamba import NULL_BLOCK_ID, MambaLM, tiny_mamba
from .runner import CAPTURE_SIZES, MAX_NUM_SEQS, NUM_SLOTS, MambaServer, Mismatch, Request, Scheduler, StepRecord
from .scenario import (MAX_NUM_BATCHED_TOKENS, UNIT_NUM_COMPUTED, UNIT_NUM_PROMPT, UNIT_NUM_REQS,
                       UNIT_NUM_REQS_PADDED, ServedRun, agreement, default_workload, describe_step, doctor_workload,
                       gpu_record, key_numbers, serve, serve_all, unit_is_prefilling, unit_split)
from .upstream import VARIANTS_WITH_GUARD, check_variant

CASE = _get("mamba_stale_is_prefilling").stem

__all__ = [
    "CAPTURE_SIZES", "CASE", "MAX_NUM_BATCHED_TOKENS", "MAX_NUM_SEQS", "NULL_BLOCK_ID", "NUM_SLOTS", "MambaLM",
    "MambaServer", "Mismatch", "Request", "Scheduler", "ServedRun", "StepRecord", "UNIT_NUM_COMPUTED",
    "UNIT_NUM_PROMPT", "UNIT_NUM_REQS", "UNIT_NUM_REQS_PADDED", "VARIANTS_WITH_GUARD", "agreement",
    "check_variant", "default_workload", "describe_step", "doctor_workload", "gpu_record", "key_numbers",
    "plot_is_prefilling", "plot_state_slots", "plot_token_agreement", "prefill_matrix", "serve", "serve_all",
    "tiny_mamba", "unit_is_prefilling", "unit_split",
]
