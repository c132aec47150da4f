"""An MTP draft head with a centroid-masked lm_head, and the proposer that graphs it (vLLM #43909).

Upstream code mirrored here, cut down to what the failure involves:

* ``MaskedEmbedder`` is ``Gemma4MTPMaskedEmbedder`` (``vllm/model_executor/models/gemma4_mtp.py``):
  centroid scores -> top-k clusters -> gather those clusters' rows of the full lm_head weight ->
  dot products -> argmax. It is checked against transformers' ``Gemma4AssistantMaskedEmbedder``.
* ``MTPDraftHead`` is the ``Gemma4MTP`` module minus its decoder layers (they produce the draft
  hidden states and never touch the lm_head; the case feeds seeded hidden states instead). Its
  lm_head is stored like vLLM's ``ParallelLMHead``: vocabulary padded to a multiple of 64, rows
  split evenly across tensor-parallel ranks. ``_get_full_lm_head_weight`` comes in two variants:

  - ``bug`` (v0.22.0): at TP>1 it returns a view of a fresh all-gather output that only the
    caller's local variable keeps alive. At TP=1 it returns a view of the parameter.
  - ``fix`` (v0.23.0, PR #43909): at TP>1 the gathered weight is made contiguous and cached on the
    module (``_stable_full_lm_head_weight``), so it lives as long as the module; ``load_weights``
    invalidates the cache.

* ``CentroidsProposer`` is the centroid part of ``Gemma4Proposer`` (``vllm/v1/spec_decode/gemma4.py``,
  v0.22.0): ``_setup_centroids_cuda_graphs`` captures one graph per size at load time, with the
  full weight gathered *outside* the capture, and ``_greedy_sample`` replays the smallest graph
  that fits. ``gather_in_capture=True`` is the other possible fix: the all-gather runs inside each
  capture, so each graph's pool owns its gathered weight (and every replay re-runs the collective).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .. import check_variant
from ...dist import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                     tensor_model_parallel_all_gather)
from ...engine import GraphManager
DEFAULT_VOCAB_PADDING_SIZE = 64                 # vllm/model_executor/layers/vocab_parallel_embedding.py
CENTROID_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # Gemma4Proposer._setup_centroids_cuda_graphs
NUM_WARMUPS = 3                                  # same place: three eager calls before each capture
CLUSTER_SPREAD = 0.5                             # spread of a cluster's lm_head rows around its direction


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """Round the vocabulary up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``)."""
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


@dataclasses.dataclass(frozen=True)
class MTPHeadConfig:
    """Sizes of the draft head. Defaults keep the gathered weight above 10 MiB (30016 x 128 fp32),
    so on CUDA the caching allocator gives it a segment of its own that ``empty_cache()`` can hand
    back to the driver, as it does Gemma4's (262,144 x 256 in bf16: 128 MiB)."""

    vocab_size: int = 30000
    hidden_size: int = 128
    num_centroids: int = 600
    centroid_intermediate_top_k: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_centroids", "centroid_intermediate_top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MTPHeadConfig.{name} must be a positive integer, got {value!r}")
        if self.vocab_size % self.num_centroids:
            raise ValueError(f"vocab_size ({self.vocab_size}) must be a multiple of num_centroids "
                             f"({self.num_centroids}): every centroid owns the same number of tokens")
        if self.centroid_intermediate_top_k > self.num_centroids:
            raise ValueError(f"centroid_intermediate_top_k ({self.centroid_intermediate_top_k}) cannot "
                             f"exceed num_centroids ({self.num_centroids})")

    @property
    def padded_vocab_size(self) -> int:
        return pad_vocab_size(self.vocab_size)

    def gathered_nbytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the all-gathered lm_head weight (all ranks' padded rows)."""
        return self.padded_vocab_size * self.hidden_size * torch.empty(0, dtype=dtype).element_size()


def make_checkpoint(config: MTPHeadConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded checkpoint with the Hugging Face names of the Gemma4 assistant's draft head.

    ``token_ordering`` is a random permutation grouping tokens into equal clusters; the lm_head rows
    of a cluster share a direction and each centroid is its cluster's mean row, so the top-k
    clusters hold the tokens that score highest, as in a trained checkpoint.
    """
    g = torch.Generator().manual_seed(seed)
    v, d, c = config.vocab_size, config.hidden_size, config.num_centroids
    token_ordering = torch.randperm(v, generator=g)
    directions = torch.randn(c, 1, d, generator=g)
    clustered = directions + CLUSTER_SPREAD * torch.randn(c, v // c, d, generator=g)
    lm_head = torch.empty(v, d)
    lm_head[token_ordering] = clustered.reshape(v, d) / d ** 0.5
    centroids = lm_head[token_ordering].view(c, v // c, d).mean(dim=1)
    return {"lm_head.weight": lm_head,
            "masked_embedding.centroids.weight": centroids,
            "masked_embedding.token_ordering": token_ordering}


class MaskedEmbedder(nn.Module):
    """Sparse logits via centroid masking (vLLM ``Gemma4MTPMaskedEmbedder``, unchanged by the fix)."""

    token_ordering: torch.Tensor

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int,
                 centroid_intermediate_top_k: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_centroids = num_centroids
        self.centroid_intermediate_top_k = centroid_intermediate_top_k
        self.vocab_size_per_centroid = vocab_size // num_centroids
        self.num_selected = centroid_intermediate_top_k * self.vocab_size_per_centroid
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.empty(vocab_size, dtype=torch.long))

    def _select_and_score(self, hidden_states: torch.Tensor,
                          lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden_states.shape[0]
        _, top_k_indices = torch.topk(self.centroids(hidden_states),
                                      k=self.centroid_intermediate_top_k, dim=-1)
        clusters = self.token_ordering.view(self.num_centroids, self.vocab_size_per_centroid)
        selected = clusters[top_k_indices]
        # The gather a captured graph replays: it reads lm_head_weight at the address it had here.
        embeddings = lm_head_weight[selected.reshape(-1)].view(num_tokens, self.num_selected,
                                                               self.hidden_size)
        logits = torch.einsum("td,tsd->ts", hidden_states, embeddings)
        return logits, selected.view(num_tokens, -1)

    def forward(self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits with the tokens of unselected clusters at the dtype's minimum."""
        logits, indices = self._select_and_score(hidden_states, lm_head_weight)
        output = torch.full((hidden_states.shape[0], self.vocab_size),
                            fill_value=torch.finfo(hidden_states.dtype).min,
                            dtype=hidden_states.dtype, device=hidden_states.device)
        return output.scatter_(-1, indices, logits)

    def get_top_tokens(self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Sparse argmax: the draft token ids, without a full-vocabulary tensor."""
        logits, indices = self._select_and_score(hidden_states, lm_head_weight)
        return indices.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)


class ParallelLMHead(nn.Module):
    """The storage of vLLM's ``ParallelLMHead``: this rank's rows of the padded vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.org_vocab_size = vocab_size
        self.num_embeddings_padded = pad_vocab_size(vocab_size)
        if self.num_embeddings_padded % self.tp_size:
            raise ValueError(f"padded vocabulary {self.num_embeddings_padded} does not split evenly "
                             f"across {self.tp_size} tensor-parallel ranks")
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, hidden_size),
                                   requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full ``[vocab, hidden]`` weight; padding rows are zero."""
        if loaded_weight.shape != (self.org_vocab_size, param.shape[1]):
            raise ValueError(f"lm_head.weight must have shape {(self.org_vocab_size, param.shape[1])}, "
                             f"got {tuple(loaded_weight.shape)}")
        start = min(self.vocab_start_index, self.org_vocab_size)
        end = min(self.vocab_start_index + self.num_embeddings_per_partition, self.org_vocab_size)
        shard = loaded_weight[start:end]
        with torch.no_grad():
            param[: shard.shape[0]].copy_(shard)
            param[shard.shape[0]:].fill_(0)


class MTPDraftHead(nn.Module):
    """The draft head of vLLM's ``Gemma4MTP``: lm_head + masked embedding, ``bug`` or ``fix``."""

    def __init__(self, config: MTPHeadConfig, variant: str = "bug") -> None:
        super().__init__()
        self.config = config
        self.variant = check_variant(variant)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.masked_embedding = MaskedEmbedder(config.hidden_size, config.vocab_size,
                                               config.num_centroids, config.centroid_intermediate_top_k)
        self._stable_full_lm_head_weight: torch.Tensor | None = None    # used by the fix only

    # -- the two versions of one method, side by side ------------------------------------------
    def _get_full_lm_head_weight(self) -> torch.Tensor:
        if self.variant == "bug":
            return self._get_full_lm_head_weight_v0_22()
        return self._get_full_lm_head_weight_v0_23()

    def _get_full_lm_head_weight_v0_22(self) -> torch.Tensor:
        """Before the fix: at TP>1 a view of a temporary that only the caller holds."""
        lm_head_weight = self.lm_head.weight
        tp_size = get_tensor_model_parallel_world_size()
        if tp_size > 1:
            lm_head_weight = tensor_model_parallel_all_gather(lm_head_weight, dim=0)
        return lm_head_weight[: self.masked_embedding.vocab_size]

    def _get_full_lm_head_weight_v0_23(self) -> torch.Tensor:
        """After the fix: at TP>1 the gathered weight is cached on the module, so it stays alive."""
        if self._stable_full_lm_head_weight is not None:
            return self._stable_full_lm_head_weight
        lm_head_weight = self.lm_head.weight
        tp_size = get_tensor_model_parallel_world_size()
        if tp_size > 1:
            lm_head_weight = tensor_model_parallel_all_gather(lm_head_weight, dim=0)
        lm_head_weight = lm_head_weight[: self.masked_embedding.vocab_size]
        if tp_size > 1:
            lm_head_weight = lm_head_weight.contiguous()
            self._stable_full_lm_head_weight = lm_head_weight
        return lm_head_weight

    # -- the rest of the module -----------------------------------------------------------------
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.masked_embedding(hidden_states, self._get_full_lm_head_weight())

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sparse argmax via centroid masking: the draft token ids."""
        return self.masked_embedding.get_top_tokens(hidden_states, self._get_full_lm_head_weight())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named weights in place (as vLLM's loaders do); returns the names loaded."""
        if self.variant == "fix":
            self._stable_full_lm_head_weight = None     # v0.23.0: a reload invalidates the cache
        params = {"lm_head.weight": self.lm_head.weight,
                  "masked_embedding.centroids.weight": self.masked_embedding.centroids.weight,
                  "masked_embedding.token_ordering": self.masked_embedding.token_ordering}
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"unexpected weight {name!r}; this head loads {sorted(params)}")
            if name == "lm_head.weight":
                self.lm_head.weight_loader(self.lm_head.weight, tensor)
            else:
                target = params[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"{name} must have shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
                with torch.no_grad():
                    target.copy_(tensor)
            loaded.add(name)
        return loaded


@dataclasses.dataclass
class CapturedWeight:
    """Where the weight the graphs read lived at capture. Holds no reference, so it cannot keep
    the memory alive: it only observes (address, size, whether its storage still exists)."""

    address: int
    nbytes: int
    weak: StorageWeakRef

    @classmethod
    def of(cls, t: torch.Tensor) -> CapturedWeight:
        storage = t.untyped_storage()
        return cls(storage.data_ptr(), storage.nbytes(), StorageWeakRef(storage))

    def alive(self) -> bool:
        return not self.weak.expired()


class CentroidsProposer:
    """The centroid top-k graphs of vLLM's ``Gemma4Proposer`` (``vllm/v1/spec_decode/gemma4.py``).

    Warmup, capture, dispatch and replay are a ``GraphManager``'s (``graph_manager``): at load
    time, three warmups then a capture per size, smallest first, each graph in its own pool, with a
    fresh static input per size made right before that size's warmups. The proposer keeps what
    upstream does around them, where the bug lives: the lm_head weight the captures read is
    gathered outside them and held only for the duration of the setup (``_capture_weight``, as
    upstream's local variable). ``on_freed`` picks the CPU emulation's outcome of reading freed memory.
    """

    def __init__(self, model: MTPDraftHead, device: str, sizes: Sequence[int] = CENTROID_GRAPH_SIZES,
                 *, gather_in_capture: bool = False, on_freed: str = "raise") -> None:
        self.model = model
        self.device = device
        self.gather_in_capture = gather_in_capture
        self.on_freed = on_freed
        self.dtype = model.lm_head.weight.dtype
        self.graph_manager = GraphManager(self._forward, sizes, device=device, num_warmups=NUM_WARMUPS,
                                          static_buffers=self._static_input, descending=False,
                                          shared_pool=False, on_freed=on_freed, name=type(self).__name__)
        self.sizes = self.graph_manager.capture_sizes
        self.captured_weight: CapturedWeight | None = None
        self._capture_weight: torch.Tensor | None = None     # the gathered weight, during setup only

    def load_model(self) -> None:
        if self.model.masked_embedding is not None:
            self._setup_centroids_cuda_graphs()

    def _setup_centroids_cuda_graphs(self) -> None:
        if self.gather_in_capture:
            lm_head_weight = None                                  # gathered inside each capture
        else:
            lm_head_weight = self.model._get_full_lm_head_weight()  # upstream: eager, OUTSIDE capture
            self.captured_weight = CapturedWeight.of(lm_head_weight)
        self._capture_weight = lm_head_weight
        del lm_head_weight
        try:
            self.graph_manager.capture()
        finally:
            self._capture_weight = None     # upstream's local goes out of scope: the proposer keeps no reference

    def _static_input(self, size: int) -> dict[str, torch.Tensor]:
        return {"hidden_states": torch.zeros(size, self.model.masked_embedding.hidden_size, dtype=self.dtype,
                                             device=self.device)}

    def _forward(self, size: int) -> torch.Tensor:
        """The captured step: top tokens of the size's static input, with the weight gathered at
        setup, or (no weight: ``gather_in_capture``, and any eager re-run after setup) gathered here."""
        hidden_states = self.graph_manager.buffers[size]["hidden_states"]
        if self._capture_weight is None:
            return self.model.get_top_tokens(hidden_states)
        return self.model.masked_embedding.get_top_tokens(hidden_states, self._capture_weight)

    @property
    def centroid_graphs(self) -> list:
        """The captured graphs, smallest size first."""
        return [pieces[0] for _, pieces in sorted(self.graph_manager.graphs.items())]

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Draft token ids: replay the graph of the size the manager dispatches to, or run eagerly
        above the largest."""
        if not self.graph_manager.graphs:
            raise RuntimeError("no centroid graphs: call load_model() first")
        T = hidden_states.shape[0]
        size = self.graph_manager.dispatch(T)
        if size is None:
            return self.model.get_top_tokens(hidden_states)
        static_input = self.graph_manager.buffers[size]["hidden_states"]
        static_input[:T].copy_(hidden_states)
        return self.graph_manager.replay(size, T, padded={"hidden_states": static_input}).clone()


def transformers_masked_embedder(config: MTPHeadConfig, seed: int = 0) -> nn.Module:
    """transformers' ``Gemma4AssistantMaskedEmbedder`` with these sizes: its own seeded init, and a
    seeded permutation as ``token_ordering`` (its init leaves zeros, a checkpoint holds a permutation)."""
    from transformers import Gemma4AssistantConfig
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantMaskedEmbedder

    text = Gemma4TextConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    hf_config = Gemma4AssistantConfig(text_config=text, use_ordered_embeddings=True,
                                      num_centroids=config.num_centroids,
                                      centroid_intermediate_top_k=config.centroid_intermediate_top_k)
    torch.manual_seed(seed)
    embedder = Gemma4AssistantMaskedEmbedder(hf_config)
    with torch.no_grad():
        embedder.token_ordering.copy_(torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed)))
    return embedder.eval()


def weights_from_transformers(embedder: nn.Module, lm_head_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint names ``MTPDraftHead.load_weights`` reads, from a transformers masked embedder."""
    weights = {f"masked_embedding.{k}": v for k, v in embedder.state_dict().items()}
    weights["lm_head.weight"] = lm_head_weight
    return weights
