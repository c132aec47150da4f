"""stable-fast's dynamic graph cache keys every non-primitive argument as ``None``: an object call reuses the None graph.

Upstream: https://github.com/chengzeyi/stable-fast/commit/139c4efcf47ebbbb4ced1cc079e28c1247b86847 ("fix hash_arg
in graphs.py", a commit on the default branch, December 2023). Diff read (``src/sfast/cuda/graphs.py``, one line),
with ``make_dynamic_graphed_callable``/``make_graphed_callable`` and ``sfast/utils/copy.py`` at that commit.
Symptom: not reported (the commit message is the title). From the code: a graphed module first called with
``None`` for an argument and later with an object in that place (an argument type the key does not
describe: not a tensor, number, string or container) is served by the graph captured for ``None``; the replay's
input copy ``tree_copy_`` then fails its ``assert type(dest) == type(src)`` (the object's tensors never reach a
graph, and the ``None`` graph took the branch without them).
Mechanism: ``make_dynamic_graphed_callable`` keeps one graphed callable per ``key = (hash_arg(args),
hash_arg(kwargs))``. ``hash_arg`` describes a tensor by device, dtype and shape, returns str/int/float/bytes
as themselves, recurses into tuples, lists and dicts, and returns ``None`` for everything else, ``None``
included. So ``f(x, None)`` and ``f(x, hint)`` have the same key: the second call gets the callable whose
graph was captured with ``control=None`` (its ``if control is not None`` branch decided at capture), and
``_GraphedModule._forward`` copies the call's inputs into that capture's static inputs with ``tree_copy_``,
which reaches ``tree_copy_(None, hint)``.
Doctor: warmup-divergence, at ``hash_arg`` (the capture of the ``None`` call fixed the graph's branch and
inputs; the reuse key cannot tell the object call from it, while an eager call takes the other branch).
Fix (upstream): ``hash_arg`` returns ``type(arg)`` instead of ``None``, so calls with differently typed
arguments get their own key and their own captured graph.
(The object is a plain class, as a dataclass would not pass ``tree_copy_`` at this commit; ``tree_copy`` keeps
it as is, so its graph reads the object's own tensor. Eager is the module called directly.)
"""
from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/chengzeyi/stable-fast/commit/139c4efcf47ebbbb4ced1cc079e28c1247b86847"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "hash_arg"
SYMPTOM = "a call passing an object where the captured call passed None is served by the None call's graph"

DIM = 4


class ControlHint:
    """An argument object carrying a tensor (a control residual), neither a tensor nor a container."""

    def __init__(self, residual: torch.Tensor):
        self.residual = residual


class Block(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(139)
        self.w1 = torch.nn.Parameter(randn(DIM, DIM, gen=gen, device=device, scale=0.5), requires_grad=False)
        self.w2 = torch.nn.Parameter(randn(DIM, DIM, gen=gen, device=device, scale=0.5), requires_grad=False)

    def forward(self, sample, temb, control=None):
        h = torch.tanh(sample @ self.w1 + temb)
        if control is not None:
            h = h + control.residual
        return h @ self.w2


def tree_copy_(dest, src):
    if isinstance(dest, torch.Tensor):
        dest.copy_(src)
    elif isinstance(dest, (list, tuple)):
        assert len(dest) == len(src)
        for x, y in zip(dest, src):
            tree_copy_(x, y)
    elif dataclasses.is_dataclass(dest):
        assert len(dest) == len(src)
        for field in dataclasses.fields(dest):
            tree_copy_(getattr(dest, field.name), getattr(src, field.name))
    elif isinstance(dest, dict):
        assert len(dest) == len(src)
        for k in dest:
            tree_copy_(dest[k], src[k])
    else:
        assert type(dest) == type(src)


def tree_copy(src):
    if isinstance(src, torch.Tensor):
        return src.clone()
    elif isinstance(src, (list, tuple)):
        return type(src)(tree_copy(x) for x in src)
    elif dataclasses.is_dataclass(src):
        return type(src)(**{field.name: tree_copy(getattr(src, field.name)) for field in dataclasses.fields(src)})
    elif isinstance(src, dict):
        return type(src)((k, tree_copy(v)) for k, v in src.items())
    else:
        return src


def tensors_of(tree, prefix):
    """The tensors the graph reads from its static inputs (announced as static buffers)."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, x in enumerate(tree) for k, v in tensors_of(x, f"{prefix}[{i}]").items()}
    if isinstance(tree, dict):
        return {k: v for n, x in tree.items() for k, v in tensors_of(x, f"{prefix}[{n}]").items()}
    return {}


def hash_arg(arg, variant):
    if isinstance(arg, torch.Tensor):
        arg_device = arg.device
        arg_device_type = arg_device.type
        return (arg_device_type, arg_device.index, arg.dtype, arg.shape,
                arg.item() if arg_device_type == 'cpu' and arg.numel() == 1 else None)
    # micro optimization: bool obj is an instance of int
    if isinstance(arg, (str, int, float, bytes)):
        return arg
    if isinstance(arg, (tuple, list)):
        return tuple(hash_arg(a, variant) for a in arg)
    if isinstance(arg, dict):
        return tuple(sorted(((hash_arg(k, variant), hash_arg(v, variant)) for k, v in arg.items()),
                            key=lambda x: x[0]))
    if variant == "bug":
        return None
    return type(arg)


def make_graphed_callable(callable, example_inputs, example_kwarg_inputs, *, device, mempool):
    static_inputs = tree_copy(example_inputs)
    static_kwarg_inputs = tree_copy(example_kwarg_inputs)
    # Warmup (3 calls on copies of the example inputs), then capture into the per-device mempool.
    fwd_graph, static_outputs = capture(
        lambda: callable(*static_inputs, **static_kwarg_inputs), device=device, pool=mempool, warmups=3,
        owner="sfast make_graphed_callable",
        static={**tensors_of(static_inputs, "args"), **tensors_of(static_kwarg_inputs, "kwargs")})

    class _GraphedModule(torch.nn.Module):
        def forward(self, *inputs, **kwarg_inputs):
            outputs = self._forward(*inputs, **kwarg_inputs)
            return tree_copy(outputs)

        def _forward(self, *inputs, **kwarg_inputs):
            tree_copy_(static_inputs, inputs)
            tree_copy_(static_kwarg_inputs, kwarg_inputs)
            return replay(fwd_graph, static_outputs)

    return _GraphedModule()


def make_dynamic_graphed_callable(callable, variant, device):
    lock = threading.Lock()
    cached_callables = {}
    mempool = graph_pool_handle(device)

    @functools.wraps(callable)
    def dynamic_graphed_callable(*args, **kwargs):
        key = (hash_arg(args, variant), hash_arg(kwargs, variant))
        cached_callable = cached_callables.get(key)
        if cached_callable is None:
            with lock:
                cached_callable = make_graphed_callable(callable, args, kwargs, device=device, mempool=mempool)
                cached_callables[key] = cached_callable
        return cached_callable(*args, **kwargs)

    dynamic_graphed_callable._cached = cached_callables
    return dynamic_graphed_callable


def run(variant: str, device: str = "cpu"):
    module = Block(device)
    gen = generator(1394)
    samples = [randn(2, DIM, gen=gen, device=device) for _ in range(4)]
    temb = randn(1, DIM, gen=gen, device=device)
    hint = ControlHint(randn(2, DIM, gen=gen, device=device))

    def serve(graphed: bool):
        fn = make_dynamic_graphed_callable(module, variant, device) if graphed else module
        with torch.no_grad():
            return [fn(samples[0], temb, None).clone(),        # captures the graph for control=None
                    fn(samples[1], temb, None).clone(),        # replays it
                    fn(samples[2], temb, hint).clone(),        # an object where None was: same key before the fix
                    fn(samples[3], temb, None).clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
