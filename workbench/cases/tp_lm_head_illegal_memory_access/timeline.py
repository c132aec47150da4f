"""What happened to the gathered weight, measured at each phase of a scenario: its address, size
and liveness, whether a later allocation took its block, what ``empty_cache()`` returned, and what
the graphs' pools hold. The figures' memory timeline and the notebook's assertions read these."""
from __future__ import annotations

import torch

from .upstream import CapturedWeight, CentroidsProposer, MTPHeadConfig

def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def setup_timeline(proposer: CentroidsProposer, variant: str, tp: int, cpu: bool,
                    reserved: int) -> dict[str, tuple[str, str]]:
    """The gathered weight from the gather to the end of setup (measured: address, size, liveness)."""
    weight = proposer.captured_weight
    if weight is None:
        held = _pool_bytes(proposer) if cpu else f"reserved +{_mb(reserved)}"
        return {"gather": ("pool", f"inside each capture:\n{held}"),
                "capture": ("pool", "each graph owns\nits gathered copy"),
                "return": ("pool", "pools live with\nthe graphs")}
    owner = ("view of the lm_head\nparameter" if tp == 1 else
             "cached on the module" if variant == "fix" else "held by a local variable")
    return {"gather": ("alive", f"{_mb(weight.nbytes)} at {weight.address:#x}\n{owner}"),
            "capture": ("alive", f"{len(proposer.sizes)} graphs keep\nthis address"),
            "return": (("alive", "still referenced") if weight.alive() else
                       ("freed", "last reference dropped;\ngraphs keep the address"))}


def seeded_noise(head: MTPHeadConfig, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The values of the later allocations: seeded noise of the gathered weight's shape, on the CPU.

    ``serve`` allocates one copy per graph, because the CPU emulation keeps a freed block per graph
    (on CUDA all graphs share one address and any one copy may land there); same values, so both
    backends read the same thing. Created outside ``reuse_freed_blocks`` so it is not placed itself.
    """
    g = torch.Generator().manual_seed(seed + 7919)
    return torch.randn(head.padded_vocab_size, head.hidden_size, generator=g).to(dtype)


def _pool_bytes(proposer: CentroidsProposer) -> str:
    """CPU emulation: what the graphs' pools hold of gathered weights, read from the recorded ops."""
    held = [sum(o.untyped_storage().nbytes() for op in g.ops if "all_gather" in op.name
                for o in op.outputs if o is not None) for g in proposer.centroid_graphs]
    return f"{len(held)} graphs own {_mb(held[0])} each" if len(set(held)) == 1 else f"{_mb(sum(held))} in all"


def reused_blocks(proposer: CentroidsProposer, weight: CapturedWeight, later: list[torch.Tensor]) -> int:
    """How many graphs now read one of ``later`` where the weight was (measured, not assumed).

    CUDA: all graphs share the weight's address, so all or none. CPU emulation: each graph keeps the
    freed block's bytes (``ExternalRef.retained``); a later tensor placed there shares its memory.
    """
    if torch.device(proposer.device).type == "cuda":
        return len(proposer.sizes) if any(t.data_ptr() == weight.address for t in later) else 0
    placed = {t.untyped_storage().data_ptr() for t in later}
    count = 0
    for g in proposer.centroid_graphs:
        refs = [r for op in g.ops for r in op.external_refs() if r.nbytes == weight.nbytes and r.weak.expired()]
        count += any(r.retained is not None and r.retained.data_ptr() in placed for r in refs)
    return count


def reuse_state(weight: CapturedWeight | None, reused: int, graphs: int, count: int) -> tuple[str, str]:
    if weight is None:
        return ("pool", f"{count} new tensors; pool\nmemory is not handed out")
    if weight.alive():
        return ("alive", f"{count} new tensors,\nplaced elsewhere")
    if reused:
        return ("reused", f"{reused} of {graphs} graphs now read\na newer tensor's values")
    return ("freed", f"{count} new tensors,\nnone in this block")


def release_state(weight: CapturedWeight | None, cpu: bool, before: int, after: int) -> tuple[str, str]:
    measured = "" if cpu else f"\nreserved {_mb(before)} -> {_mb(after)}"
    if weight is None:
        return ("pool", "graph pools are kept" + measured)
    if weight.alive():
        return ("alive", "in use: not released" + measured)
    return ("released", ("emulated: the block is gone,\na read raises" if cpu else "segment returned\nto the driver")
            + measured)
