"""MJX-Warp in ``GraphMode.WARP_STAGED``: the generated shim stages in and out only ``mjx.Data`` fields, so the
``DataWarp`` outputs (``d._impl.actuator_velocity``) are never copied from the graph's staging buffers back to XLA.

Upstream: https://github.com/google-deepmind/mujoco/commit/a1d772c9adc86aad67c480586e3b6311c6c756db ("Import
google-deepmind/mujoco_warp from GitHub.", Taylor Howell, 2026-08-06), which fixes
https://github.com/google-deepmind/mujoco/issues/3456 ("MJX-Warp: actuator_velocity in GraphMode.WARP_STAGED is all
zeroes", opened 2026-08-04). Read here: the issue text (the reporter found that adding ``'actuator_velocity'`` to
``stage_out_argnames`` in ``mjx/warp/forward.py`` gives non-zero values), the commit's diff of
``mjx/codegen/generate_warp_shim.py`` (``_get_stage_fields``) and of the regenerated ``mjx/warp/forward.py``
(``stage_in_argnames`` / ``stage_out_argnames`` gain ``actuator_moment``, ``actuator_velocity``, ``cJ``, ``cM``, ...),
the pre-fix ``forward.py`` (``in_out_argnames``, the ``jax_callable_variadic_tuple`` call,
``'_impl.actuator_velocity': out[5]``), ``mjx/warp/types.py`` (``DataWarp.actuator_velocity: jax.Array``), and
Warp's ``warp/_src/jax/ffi.py`` at the same date (``FfiCallable.ffi_callback``'s ``WARP_STAGED`` branches and
``_prepare_staging``). Not read: the commit's mujoco_warp kernel changes, and any maintainer comment on the issue.
Symptom: with ``m.opt._impl.graph_mode = GraphMode.WARP_STAGED`` (chosen to save memory), ``d._impl.actuator_velocity``
returned by ``mjx.forward`` / ``mjx.step`` is all zeros, while ``GraphMode.WARP`` and MJX-JAX give the real actuator
velocities. Nothing raises. The rest of the state (forces, positions) is right.
Mechanism: ``_forward_jax_impl`` calls Warp's ``jax_callable`` with the Data fields as ``in_out_argnames`` (XLA
aliases each such output with its input buffer) and with ``stage_in_argnames`` / ``stage_out_argnames`` written by
the MJX codegen. In ``WARP_STAGED`` the first ``ffi_callback`` runs ``_prepare_staging``: every non-empty array
argument gets a staging array (``wp.empty_like``) that the graph is captured against. Arguments named in
``stage_in_argnames`` get an input memcpy node inside the graph (XLA buffer to staging), those in
``stage_out_argnames`` an output memcpy node (staging to XLA buffer); every other argument is copied into its staging
array once (``wp.copy(staging_arr, arg)``) and never again, and an output not named is "not copied back". Replays
re-point the memcpy nodes (``wp_cuda_graph_update_memcpy_batch``) and launch the graph. The codegen's
``_get_stage_fields`` kept a data field only when ``mjx_types.Data`` annotates it as ``jax.Array``; the fields of
``DataWarp`` (``d._impl``: ``actuator_moment``, ``actuator_velocity``, ...) were dropped from both lists. The forward
kernels still write ``actuator_velocity`` into its staging array on every replay, but no memcpy node copies it out,
so the aliased XLA output buffer keeps the value the step received: zeros from ``make_data``, step after step.
Doctor: stale-input, at _get_stage_fields. The buffer handed back to XLA as ``actuator_velocity`` is one the step's
graph never writes (its refresh, the stage-out copy, was omitted), so what the user reads is what an earlier step
left in it. The lists that omit it are built in ``_get_stage_fields``.
Fix (upstream): ``_get_stage_fields`` also accepts fields annotated ``jax.Array`` on ``DataWarp`` (and
``ModelWarp`` / ``OptionWarp``), for both stage-in and stage-out; the regenerated shims list the DataWarp fields.
Modelled: the codegen's ``_get_stage_fields`` over a ``FieldUsage``; ``Data`` / ``DataWarp`` / ``Model`` as
annotated field holders; a one-kernel-per-quantity forward (transmission moment from ``qpos``, actuator length and
velocity, a damped motor force, ``qfrc_actuator``) as the Warp function; Warp's ``FfiCallable`` with
``_prepare_staging`` and the ``WARP_STAGED`` and ``NONE`` paths of ``ffi_callback``; the user's loop
(``forward`` then semi-implicit Euler on the JAX side). Stand-ins: XLA's buffers are one fixed tensor per argument
(the addresses a donated loop settles on), filled with the call's inputs before the launch, so
``wp_cuda_graph_update_memcpy_batch`` has nothing to change; the graph is an engine graph captured without warm-up
and launched at once (``wp.capture_launch``), as Warp does. vmap, ``WARP_STAGED_EX`` and the other 140 fields are
left out.
Workload: 4 worlds, 3 dofs, 2 actuators, 5 steps with a new ``ctrl`` each step. Each step returns
``d._impl.actuator_velocity``, ``d.actuator_force`` and ``d.qpos``. Eager (``GraphMode.NONE``) returns velocities
up to 1.8, 2.1, 2.1, 2.4 and 2.1 in magnitude. The bug's velocities are 0.0 in all 5 steps (max error 2.36); forces and
positions match eager exactly (the kernels read the staging arrays, which the graph does write). The fix equals
eager.
"""

from enum import IntEnum

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/google-deepmind/mujoco/commit/a1d772c9adc86aad67c480586e3b6311c6c756db"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_get_stage_fields"
SYMPTOM = ("MJX-Warp GraphMode.WARP_STAGED: the codegen stages only mjx.Data fields, so DataWarp outputs such as "
           "d._impl.actuator_velocity are never copied out of the graph's staging buffers; the user sees the "
           "input value (zeros) on every step")

NWORLD, NV, NU, STEPS = 4, 3, 2, 5
DT = 0.05

_variant = "bug"


class jax:                                       # the one name the codegen's annotation check looks at
    Array = torch.Tensor


class GraphMode(IntEnum):
    NONE = 0
    JAX = 1
    WARP = 2
    WARP_STAGED = 3


# --- mjx/_src/types.py, mjx/warp/types.py: which class annotates which field ----------------------------------------

class Model:
    actuator_gear: jax.Array
    actuator_gainprm: jax.Array
    actuator_damping: jax.Array


class Data:
    qpos: jax.Array
    qvel: jax.Array
    ctrl: jax.Array
    actuator_length: jax.Array
    actuator_force: jax.Array
    qfrc_actuator: jax.Array


class DataWarp:                                  # d._impl under impl='warp'
    actuator_moment: jax.Array
    actuator_velocity: jax.Array


class FieldUsage:
    """What the codegen's trace of ``mujoco_warp.forward`` found it reads and writes."""
    model_fields = ["actuator_damping", "actuator_gainprm", "actuator_gear"]
    data_fields = ["actuator_force", "actuator_length", "actuator_moment", "actuator_velocity", "ctrl",
                   "qfrc_actuator", "qpos", "qvel"]
    data_out_fields = ["actuator_force", "actuator_length", "actuator_moment", "actuator_velocity", "qfrc_actuator"]


# --- mjx/codegen/generate_warp_shim.py -------------------------------------------------------------------------------

def _get_stage_fields(field_usage):
    stage_in, stage_out = [], []

    def is_jax_array(cls, field):
        if cls is None:
            return False
        return cls.__annotations__.get(field) is jax.Array

    DataWarp_ = DataWarp if _variant == "fix" else None     # the fix: DataWarp fields are staged too

    # stage_in: Model jax.Array input fields
    for field in field_usage.model_fields:
        if is_jax_array(Model, field):
            stage_in.append(field)
    # stage_in: Data/DataWarp jax.Array input fields
    for field in field_usage.data_fields:
        if is_jax_array(Data, field) or is_jax_array(DataWarp_, field):
            stage_in.append(field)
    # stage_out: Data/DataWarp jax.Array output fields
    for field in field_usage.data_out_fields:
        if is_jax_array(Data, field) or is_jax_array(DataWarp_, field):
            stage_out.append(field)
    return sorted(stage_in), sorted(stage_out)


# --- mujoco_warp forward, as the Warp function the shim wraps (one wp.launch per quantity) --------------------------

def _forward_shim(actuator_damping, actuator_gainprm, actuator_gear, ctrl, qpos, qvel,
                  actuator_force, actuator_length, actuator_moment, actuator_velocity, qfrc_actuator):
    actuator_moment.copy_(actuator_gear.unsqueeze(0) * torch.cos(qpos).unsqueeze(1))       # transmission
    actuator_length.copy_(torch.einsum("wuv,wv->wu", actuator_moment, qpos))
    actuator_velocity.copy_(torch.einsum("wuv,wv->wu", actuator_moment, qvel))
    actuator_force.copy_(actuator_gainprm * ctrl - actuator_damping * actuator_velocity)
    qfrc_actuator.copy_(torch.einsum("wuv,wu->wv", actuator_moment, actuator_force))


ARGS = ["actuator_damping", "actuator_gainprm", "actuator_gear", "ctrl", "qpos", "qvel",
        "actuator_force", "actuator_length", "actuator_moment", "actuator_velocity", "qfrc_actuator"]


# --- warp/_src/jax/ffi.py ----------------------------------------------------------------------------------------------

class FfiCallDesc:
    capture = None


class FfiCallable:
    def __init__(self, func, in_out_argnames, stage_in_argnames, stage_out_argnames, graph_mode):
        self.func, self.graph_mode = func, graph_mode
        self.in_out_argnames = set(in_out_argnames)
        self.stage_in_argnames = set(stage_in_argnames) if stage_in_argnames else None
        self.stage_out_argnames = set(stage_out_argnames) if stage_out_argnames else None
        self.call_desc = FfiCallDesc()

    def _prepare_staging(self, buffers, call_desc):
        """Staging arrays for every array argument; copies for the named ones, a one-time copy for the rest."""
        call_desc.staging, call_desc.memcpy_in, call_desc.memcpy_out = {}, [], []
        for name in ARGS:
            arg = buffers[name]
            staging_arr = torch.empty_like(arg)                                   # wp.empty_like(arg)
            if self.stage_in_argnames is None or name in self.stage_in_argnames:
                call_desc.memcpy_in.append(name)
            else:
                staging_arr.copy_(arg)                                            # wp.copy(staging_arr, arg), once
            if name in self.in_out_argnames:                                      # other outputs: not copied back
                if self.stage_out_argnames is None or name in self.stage_out_argnames:
                    call_desc.memcpy_out.append(name)
            call_desc.staging[name] = staging_arr

    def ffi_callback(self, buffers):
        """One XLA call. ``buffers``: the call's XLA buffers by argument name (in-out ones hold their input)."""
        call_desc = self.call_desc
        if self.graph_mode == GraphMode.WARP_STAGED:
            if call_desc.capture is not None:
                # wp_cuda_graph_update_memcpy_batch (same buffers here), then wp_cuda_graph_launch
                replay(call_desc.capture, call_desc.outputs)
                return
            self._prepare_staging(buffers, call_desc)
            staging = call_desc.staging

            def graph_body():
                for name in call_desc.memcpy_in:                                  # input memcpy nodes
                    staging[name].copy_(buffers[name])
                self.func(*(staging[name] for name in ARGS))
                for name in call_desc.memcpy_out:                                 # output memcpy nodes
                    buffers[name].copy_(staging[name])
                return tuple(buffers[name] for name in sorted(self.in_out_argnames))

            call_desc.outputs = tuple(buffers[name] for name in sorted(self.in_out_argnames))
            graph, _ = capture(graph_body, device=str(buffers["qpos"].device), warmups=0,
                               name="mjx-warp forward (WARP_STAGED)", owner="FfiCallable WARP_STAGED",
                               static={f"xla:{n}": buffers[n] for n in ARGS},
                               state={f"staging:{n}": staging[n] for n in ARGS})
            call_desc.capture = graph
            replay(graph, call_desc.outputs)                                      # wp.capture_launch(capture.graph)
            return
        self.func(*(buffers[name] for name in ARGS))                              # GraphMode.NONE


def jax_callable(func, in_out_argnames, stage_in_argnames, stage_out_argnames, graph_mode):
    return FfiCallable(func, in_out_argnames, stage_in_argnames, stage_out_argnames, graph_mode)


# --- mjx/warp/forward.py (generated) -------------------------------------------------------------------------------------

class XLA:
    """The call's device buffers: one fixed tensor per argument; in-out outputs alias their inputs."""

    def __init__(self):
        self.buffers = None

    def call(self, jf, m, d):
        values = {**m, **{k: v for k, v in d.items() if k != "_impl"}, **d["_impl"]}
        if self.buffers is None:
            self.buffers = {name: torch.empty_like(values[name]) for name in ARGS}
        for name in ARGS:                                                          # the inputs land in the buffers
            self.buffers[name].copy_(values[name])
        jf.ffi_callback(self.buffers)
        return {name: self.buffers[name].clone() for name in sorted(jf.in_out_argnames)}


def _forward_jax_impl(m, d, state):
    if state.get("jf") is None:
        stage_in, stage_out = _get_stage_fields(FieldUsage)
        state["jf"] = jax_callable(_forward_shim, in_out_argnames=FieldUsage.data_out_fields,
                                   stage_in_argnames=stage_in, stage_out_argnames=stage_out,
                                   graph_mode=m["graph_mode"])
    out = state["xla"].call(state["jf"], {k: v for k, v in m.items() if k != "graph_mode"}, d)
    d = {**d, "_impl": dict(d["_impl"])}
    d["actuator_force"], d["actuator_length"] = out["actuator_force"], out["actuator_length"]
    d["_impl"]["actuator_moment"] = out["actuator_moment"]
    d["_impl"]["actuator_velocity"] = out["actuator_velocity"]
    d["qfrc_actuator"] = out["qfrc_actuator"]
    return d


# --- the user's loop ---------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(3456)
    gear = randn(NU, NV, gen=gen, device=device)
    gain = randn(NU, gen=gen, device=device).abs() + 0.5
    damping = randn(NU, gen=gen, device=device).abs() * 0.2
    qpos0 = randn(NWORLD, NV, gen=gen, device=device, scale=0.5)
    qvel0 = randn(NWORLD, NV, gen=gen, device=device)
    ctrls = [randn(NWORLD, NU, gen=gen, device=device) for _ in range(STEPS)]

    def rollout(graph_mode):
        m = {"actuator_gear": gear, "actuator_gainprm": gain, "actuator_damping": damping, "graph_mode": graph_mode}
        zeros = lambda *s: torch.zeros(*s, device=device)  # noqa: E731 - make_data
        d = {"qpos": qpos0.clone(), "qvel": qvel0.clone(), "ctrl": zeros(NWORLD, NU),
             "actuator_length": zeros(NWORLD, NU), "actuator_force": zeros(NWORLD, NU),
             "qfrc_actuator": zeros(NWORLD, NV),
             "_impl": {"actuator_moment": zeros(NWORLD, NU, NV), "actuator_velocity": zeros(NWORLD, NU)}}
        state = {"xla": XLA()}
        outs = []
        for ctrl in ctrls:
            d = {**d, "ctrl": ctrl}
            d = _forward_jax_impl(m, d, state)
            outs += [d["_impl"]["actuator_velocity"], d["actuator_force"], d["qpos"]]
            qvel = d["qvel"] + DT * d["qfrc_actuator"]                             # JAX-side semi-implicit Euler
            d = {**d, "qvel": qvel, "qpos": d["qpos"] + DT * qvel}
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: rollout(GraphMode.WARP_STAGED), lambda: rollout(GraphMode.NONE))
