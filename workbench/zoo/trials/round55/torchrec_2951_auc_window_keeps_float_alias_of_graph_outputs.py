"""The AUC metric's window keeps the graphed model's output tensors; the next replay overwrites every entry.

Upstream: https://github.com/pytorch/torchrec/pull/2951 ("enable cudagraph for AUCMetricComputation", commit
00a90149c16d7f273555a40009914b3ac5bec7c5). Diff read (``metrics_config.py``, ``metric_module.py``, ``rec_metric.py``)
and ``torchrec/metrics/auc.py`` at that commit.
Symptom: "enable cudagraph leads to errors on AUCMetricComputation": "model forward output tensors ``predictions``,
``labels``, ``weights``, and ``grouping_keys`` got overwritten by the next CUDAGraph replay" (torch.compile
cudagraph trees raise on the access; without the check the windowed AUC is computed from the last batch only).
Mechanism: the model forward runs under CUDA graphs, so the ``predictions`` / ``labels`` handed to
``RecMetricModule.update`` are the graph's static output buffers, valid until its next replay.
``RecMetric._update`` (fused tasks) reshapes them with ``.view(len(self._tasks), -1)`` (a view) and calls
``AUCMetricComputation.update``, which does ``predictions = predictions.float()`` / ``labels = labels.float()``: on
float32 tensors that returns the tensor itself, no copy. It then ``append``s them to the ``PREDICTIONS`` /
``LABELS`` / ``WEIGHTS`` list states, a window of past batches that ``_compute`` later concatenates
(``_concat_if_needed`` -> ``torch.cat``). Every entry of the window aliases the same graph output memory, so after
the next replay the "window" holds N copies of the newest batch. Eager forwards return fresh tensors per batch.
(Emulation: one graph captured with ``capture``/``replay`` stands for the reduce-overhead cudagraph tree; its
outputs are static buffers handed out as views. Only ``weights=None`` -> ``_create_default_weights`` is fresh.)
Doctor: overwritten-output, at ``_update`` (it passes the handed-out graph outputs on to a metric state that keeps
them, through the aliasing ``.view``/``.float()``, across later replays; ``_compute`` reads them after).
Fix (upstream): ``MetricsConfig.should_clone_update_inputs`` -> ``RecMetric._should_clone_update_inputs``;
``_update`` first calls the new ``clone_update_inputs`` (``.clone()`` of predictions, labels, weights and every
``required_inputs`` entry) under ``torch.no_grad()``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/torchrec/pull/2951"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "_update"
SYMPTOM = "windowed AUC computed from N aliases of the newest batch's graph output (overwritten model outputs)"

N_TASKS, BATCH, DENSE, WINDOW, STEPS = 2, 8, 6, 24, 6
PREDICTIONS, LABELS, WEIGHTS = "predictions", "labels", "weights"


def _concat_if_needed(predictions, labels, weights):
    if len(predictions) > 1:
        return torch.cat(predictions, dim=-1), torch.cat(labels, dim=-1), torch.cat(weights, dim=-1)
    return predictions[0], labels[0], weights[0]


def _compute_auc_helper(predictions, labels, weights):
    sorted_indices = torch.argsort(predictions, descending=True, dim=-1)
    sorted_labels = torch.index_select(labels, dim=0, index=sorted_indices)
    sorted_weights = torch.index_select(weights, dim=0, index=sorted_indices)
    cum_fp = torch.cumsum(sorted_weights * (1.0 - sorted_labels), dim=0)
    cum_tp = torch.cumsum(sorted_weights * sorted_labels, dim=0)
    return torch.where(cum_fp[-1] * cum_tp[-1] == 0, 0.5, torch.trapz(cum_tp, cum_fp) / cum_fp[-1] / cum_tp[-1])


def compute_auc(n_tasks, predictions, labels, weights):
    preds_t, labels_t, weights_t = _concat_if_needed(predictions, labels, weights)
    return torch.cat([_compute_auc_helper(p, lab, w).view(1) for p, lab, w in zip(preds_t, labels_t, weights_t)])


class AUCMetricComputation:
    """``torchrec/metrics/auc.py``: list states holding a window of past batches."""

    def __init__(self, n_tasks, window_size, device):
        self._n_tasks, self._window_size, self.device = n_tasks, window_size, device
        self._states = {PREDICTIONS: [], LABELS: [], WEIGHTS: []}
        self._init_states()

    def _init_states(self):
        self._num_samples = 0
        for name in (PREDICTIONS, LABELS, WEIGHTS):
            self._states[name].append(torch.zeros((self._n_tasks, 1), dtype=torch.float, device=self.device))

    def update(self, *, predictions, labels, weights, **kwargs):
        predictions = predictions.float()          # float32 already: the same tensor, not a copy
        labels = labels.float()
        weights = weights.float()
        batch_size = predictions.size(-1)
        w_preds, w_labels, w_weights = (self._states[n] for n in (PREDICTIONS, LABELS, WEIGHTS))
        if self._num_samples == 0:                 # remove init states
            for lst in (w_preds, w_labels, w_weights):
                lst.pop(0)
        w_preds.append(predictions)
        w_labels.append(labels)
        w_weights.append(weights)
        self._num_samples += batch_size
        while self._num_samples > self._window_size:
            diff = self._num_samples - self._window_size
            if diff > w_preds[0].size(-1):
                self._num_samples -= w_preds[0].size(-1)
                for lst in (w_preds, w_labels, w_weights):
                    lst.pop(0)
            else:
                for lst in (w_preds, w_labels, w_weights):
                    lst[0] = lst[0][:, diff:]
                    if torch.numel(lst[0]) == 0:
                        lst.pop(0)
                self._num_samples -= diff

    def _compute(self):
        return compute_auc(self._n_tasks, self._states[PREDICTIONS], self._states[LABELS], self._states[WEIGHTS])


class RecMetric:
    """``AUCMetric`` in ``RecComputeMode.FUSED_TASKS_COMPUTATION``."""

    def __init__(self, n_tasks, window_size, device, should_clone_update_inputs):
        self._n_tasks = n_tasks
        self._should_clone_update_inputs = should_clone_update_inputs
        self._metrics_computations = [AUCMetricComputation(n_tasks, window_size, device)]

    def clone_update_inputs(self, predictions, labels, weights, **kwargs):
        predictions, labels = predictions.clone(), labels.clone()
        if weights is not None:
            weights = weights.clone()
        if "required_inputs" in kwargs:
            kwargs["required_inputs"] = {k: v.clone() for k, v in kwargs["required_inputs"].items()}
        return predictions, labels, weights, kwargs

    def _create_default_weights(self, predictions):
        return torch.ones_like(predictions)

    def _update(self, *, predictions, labels, weights, **kwargs):
        with torch.no_grad():
            if self._should_clone_update_inputs:
                predictions, labels, weights, kwargs = self.clone_update_inputs(predictions, labels, weights, **kwargs)
            predictions = predictions.view(self._n_tasks, -1)
            labels = labels.view(self._n_tasks, -1)
            weights = self._create_default_weights(predictions) if weights is None else weights.view(self._n_tasks, -1)
            self._metrics_computations[0].update(predictions=predictions, labels=labels, weights=weights, **kwargs)

    def compute(self):
        return self._metrics_computations[0]._compute()


class TwoTaskRanker:
    """The trained model: one dense tower, one logit per task; forward returns the metric's model outputs."""

    def __init__(self, device):
        gen = generator(2951)
        self.w = randn(N_TASKS, DENSE, gen=gen, device=device)
        self.b = randn(N_TASKS, gen=gen, device=device, scale=0.1)

    def forward(self, dense, clicks):
        predictions = torch.sigmoid(torch.nn.functional.linear(dense, self.w, self.b)).t()   # [n_tasks, B]
        labels = clicks.to(torch.float32)                                                    # [n_tasks, B]
        return predictions, labels


def batches(device):
    gen = generator(29510)
    out = []
    for _ in range(STEPS):
        dense = randn(BATCH, DENSE, gen=gen, device=device)
        clicks = (torch.rand(N_TASKS, BATCH, generator=gen) < 0.5).to(torch.int64)
        clicks[:, 0], clicks[:, 1] = 0, 1                       # both classes in every batch
        out.append((dense, clicks.to(device)))
    return out


def run(variant: str, device: str = "cpu"):
    model, data = TwoTaskRanker(device), batches(device)

    def eager():
        metric, aucs = RecMetric(N_TASKS, WINDOW, device, variant == "fix"), []
        for dense, clicks in data:
            predictions, labels = model.forward(dense, clicks)
            metric._update(predictions=predictions, labels=labels, weights=None)
            aucs.append(metric.compute().clone())
        return aucs

    def served():
        metric, aucs = RecMetric(N_TASKS, WINDOW, device, variant == "fix"), []
        static_dense, static_clicks = data[0][0].clone(), data[0][1].clone()
        g, outputs = capture(lambda: model.forward(static_dense, static_clicks), device=device,
                             name="reduce-overhead forward", owner="torch.compile cudagraph tree",
                             static={"dense": static_dense, "clicks": static_clicks})
        for dense, clicks in data:
            static_dense.copy_(dense)
            static_clicks.copy_(clicks)
            predictions, labels = replay(g, outputs)
            metric._update(predictions=predictions, labels=labels, weights=None)
            aucs.append(metric.compute().clone())
        return aucs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
