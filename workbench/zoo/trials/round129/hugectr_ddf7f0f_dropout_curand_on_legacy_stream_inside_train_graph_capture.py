"""HugeCTR's dense ``Network::train`` captured every layer's ``fprop`` into a CUDA graph (relaxed capture on the GPU
resource's blocking stream, no warmup) as soon as graphs were introduced; a model with a ``Dropout`` layer (the DCN,
DeepFM and WDL samples) draws its mask inside that capture with ``curandGenerateUniform`` on a cuRAND generator whose
stream was never set, i.e. on the legacy default stream. CUDA refuses a launch onto the legacy stream while a blocking
stream of the context is capturing, so the first training iteration fails; the fix binds the generator to the layer's
stream and turns CUDA graphs off for any network that holds a Dropout layer.

Upstream: https://github.com/NVIDIA-Merlin/HugeCTR/commit/ddf7f0f8a391accafd8139cae88e0ed897c3ae06 ("Fixed cudaGraph
and curand incompatibility issue", NVIDIA-Merlin/HugeCTR, author Gems Guo, 2020-07-01; committed on the v2.2
integration line, an ancestor of ``main``: merged). Read (paths under ``HugeCTR/``): the commit's whole diff
(``src/network.cu``: ``Network::train`` / ``Network::eval`` capture and launch only ``if (enable_cuda_graph_)``, else run the layers
eagerly; ``include/network.hpp``: ``bool enable_cuda_graph_{true}``; ``src/parser.cpp``: ``create_network``'s
``Layer_t::Dropout`` case sets ``network->enable_cuda_graph_ = false``; ``src/layers/dropout_layer.cu``:
``DropoutLayer::fprop`` calls ``curandSetStream(curand_generator_, stream)`` before ``curandGenerateUniform``; plus
a Dockerfile line, a missing ``break`` in the learning-rate parser, tools' key types and an embedding tensor, unrelated
to graphs). At its parent ``ddf7f0f8a^``: ``src/network.cu`` (``Network`` constructor, ``train``, ``eval``,
``update_params``), ``include/network.hpp``, ``include/gpu_resource.hpp`` (``GPUResource``: ``cudaStreamCreate(&stream_)``,
``curandCreateGenerator`` with no stream, ``get_curand_generator``), ``src/layers/dropout_layer.cu`` (constructor seeding
the shared generator, ``fprop``, ``bprop``, ``inference``, ``prop_common``, ``dropout_kernel``),
``src/layers/fully_connected_layer.cu`` (``fprop``, ``bprop`` with ``beta_w = 1`` accumulation, ``cal_bias_grad``),
``src/layers/relu_layer.cu``, ``include/layer.hpp`` (``inference`` defaults to ``fprop``), ``src/loss.cu``
(``Loss::compute``, ``BinaryCrossEntropy_Kernel`` writing the gradient or the probability into its input in place),
``src/regularizers/no_regularizer.cu`` / ``src/regularizer.cu`` (``initialize_wgrad``),
``src/optimizers/momentum_sgd.cu``, ``src/parser.cpp`` (``create_network``'s Dropout case and optimizer switch, the
``create_pipeline`` loop building a train and an eval network per GPU with ``set_weight``), ``src/session.cpp``
(``Session::train``, ``Session::eval``). Also read: ``git log -S cudaStreamBeginCapture`` (graphs entered
``network.cu`` in 87c29634d "a100-preview", 2020-06-29), the samples using ``"Dropout"`` at the parent, and the later
commits 92bba645b ("Make CUDA Graph configurable") and f4fdcf16d ("Use cuDNN Dropout instead of our own imple to use
cudaGraph", which turned graphs back on for dropout models).
Not read: the data readers, the sparse embeddings, the multi-GPU ``exchange_wgrad`` / NCCL path, cuRAND's sources (its
stream semantics are CUDA's documented ones), the mixed-precision path.
Symptom: no issue thread; the commit calls it a "cudaGraph and curand incompatibility issue". As modelled from the code:
on the parent, training any model with a Dropout layer fails in the first ``Session::train()``: the cuRAND call inside
the fprop capture returns a launch failure (``CK_CURAND_THROW_``), from CUDA's ``cudaErrorStreamCaptureImplicit``
("operation would make the legacy stream depend on a capturing blocking stream"). Models without Dropout train.
Mechanism: ``GPUResource`` creates its compute stream with ``cudaStreamCreate`` (a blocking stream, synchronised with
the legacy default stream) and a cuRAND generator it never binds to a stream, so cuRAND launches on stream 0, the
legacy stream. ``Network::train`` opens ``cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed)`` and runs every
layer's ``fprop``; ``DropoutLayer::fprop`` calls ``curandGenerateUniform(curand_generator_, mask_, n)``, whose kernel
goes to the legacy stream. Work on the legacy stream waits for all blocking streams, so it would depend on the stream
being captured; CUDA refuses it whatever the capture mode and invalidates the capture. Even bound to the captured
stream, the generator's Philox offset is host state that cuRAND advances per call and passes to its kernel by value, so
replays of the captured mask kernel would redraw the capture's mask: graphs and this dropout do not mix, which is why the
fix turns them off rather than only setting the stream.
Doctor: sync-in-capture, at train. The captured region attempts a synchronisation with the capturing stream (the legacy
stream's implicit wait on every blocking stream), which CUDA refuses during capture; ``Network::train`` is where every
network's fprop was captured unconditionally and where the fix lets a Dropout network run eagerly.
Fix (upstream): ``create_network`` clears ``enable_cuda_graph_`` when it builds a Dropout layer; ``Network::train`` and
``Network::eval`` skip capture and launch the layers eagerly when it is clear; ``DropoutLayer::fprop`` binds the
generator to the layer's stream (``curandSetStream``) so its kernel is ordered on the compute stream.
Modelled: ``GPUResource`` (blocking ``stream_``, shared ``curand_generator_``), cuRAND's host API as far as used
(``curandCreateGenerator`` / ``curandSetPseudoRandomGeneratorSeed`` / ``curandSetStream`` / ``curandGenerateUniform``
with a host-held Philox offset), ``GeneralBuffer`` (``reserve`` / ``init`` / ``replace_buffer_with``, tensors as views
into it), ``FullyConnectedLayer`` (row-major ``fprop`` / ``bprop``), ``ReluLayer``, ``DropoutLayer`` (``fprop`` /
``bprop`` / ``inference`` / ``prop_common``), ``BinaryCrossEntropyLoss::compute`` with ``NoRegularizer``'s
``initialize_wgrad``, ``MomentumSGD::update``, ``Network`` (``train`` with its fprop and bprop graphs, ``eval`` with
its eval graph, ``update_params``, ``set_weight``), ``create_network`` and the ``create_pipeline`` loop (train and eval
network sharing weights), ``Session::train`` / ``Session::eval`` for one GPU.
Stand-ins: the data reader is a static dense-input and label buffer the session copies each batch into (no sparse
embedding: the first FC layer reads the dense input directly); ``cudaStreamBeginCapture`` ... ``cudaGraphLaunch`` are
the engine's ``capture`` (no warmup, as upstream) and ``replay``; a kernel launched onto the legacy stream is the
engine's ``synchronize`` (the legacy stream's implicit wait on all blocking streams, which CUDA refuses during a capture
as it refuses a host synchronisation); cuRAND's XORWOW generator is a torch CPU generator seeded from (seed, offset),
its numbers copied to the device; ``DropoutLayer::get_seed`` reads ``/dev/urandom`` upstream and is a fixed seed here so
that the graph run and the eager run draw the same masks. The eager reference is the same session with graphs off (the
``enable_cuda_graph_`` switch the fix added, later exposed as a solver option by 92bba645b); in the bug variant the
served run keeps it on for every network, as the parent's unconditional capture did. float64 throughout.
Workload: one GPU, batch 8, dense input 4, layers FC(4, 8) -> ReLU -> Dropout(0.5) -> FC(8, 1) -> BinaryCrossEntropyLoss,
MomentumSGD (lr 0.1, momentum 0.9), 4 training iterations then 2 evaluation batches. Outputs: the training loss of
each iteration, the trained weights, the evaluation losses and predictions.
Measured: bug: raises CaptureError in the first ``Session::train()``, inside the fprop capture, at the Dropout layer's
``curandGenerateUniform`` ("synchronize() inside graph capture needs the device's values on the host (a host
synchronisation), ..."). Fix: both networks hold a Dropout layer, so neither captures; equals eager
(max |graph - eager| = 0). Checks of the model itself (not variants): the same session without the Dropout layer
captures the fprop, bprop and eval graphs and equals eager (0); with the generator bound to the stream but graphs kept
on (the fix's first hunk alone) the capture succeeds and every replay reuses the capture's mask: 0.338.
"""
from __future__ import annotations

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA-Merlin/HugeCTR/commit/ddf7f0f8a391accafd8139cae88e0ed897c3ae06"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "train"
SYMPTOM = ("training a model with a Dropout layer fails on the first iteration: the layer's cuRAND mask generation runs "
           "on the legacy default stream inside the fprop graph capture, which CUDA refuses")

BATCH, DENSE_DIM, HIDDEN = 8, 4, 8
DROPOUT_RATE = 0.5
LR, MOMENTUM_FACTOR, SCALER = 0.1, 0.9, 1.0
TRAIN_ITERS, EVAL_BATCHES = 4, 2
DTYPE = torch.float64

_variant = "bug"


# --- cuRAND host API (as far as HugeCTR uses it) -------------------------------------------------------------------

cudaStreamLegacy = None          # stream 0: the legacy default stream


class curandGenerator_t:
    def __init__(self, device):
        self.device = device
        self.stream = cudaStreamLegacy       # curandCreateGenerator: no stream until curandSetStream
        self.seed = 0
        self.offset = 0                      # Philox/XORWOW offset, advanced on the host per call


def curandCreateGenerator(device):
    return curandGenerator_t(device)


def curandSetPseudoRandomGeneratorSeed(generator, seed):
    generator.seed, generator.offset = seed, 0


def curandSetStream(generator, stream):
    generator.stream = stream


def _launch_on(stream, device):
    """A kernel launch on ``stream``. On the legacy stream it first waits for every blocking stream of the context
    (``cudaStreamCreate`` streams); while one of them is capturing CUDA refuses the launch
    (``cudaErrorStreamCaptureImplicit``) as it refuses a synchronisation."""
    if stream is cudaStreamLegacy:
        synchronize(device)


def curandGenerateUniform(generator, outputPtr, num):
    _launch_on(generator.stream, generator.device)
    g = torch.Generator().manual_seed(generator.seed * 1_000_003 + generator.offset)
    values = torch.rand(num, generator=g, dtype=DTYPE)
    outputPtr.view(-1)[:num].copy_(values.to(outputPtr.device))
    generator.offset += num


# --- include/gpu_resource.hpp --------------------------------------------------------------------------------------

class GPUResource:
    def __init__(self, device_id, device):
        self.device_id_, self.device = device_id, device
        self.curand_generator_ = curandCreateGenerator(device)
        self.stream_ = "stream_"             # cudaStreamCreate(&stream_): a blocking stream

    def get_stream(self):
        return self.stream_

    def get_curand_generator(self):
        return self.curand_generator_


# --- include/general_buffer.hpp / tensor.hpp -----------------------------------------------------------------------

class GeneralBuffer:
    def __init__(self):
        self.num_elements, self.data = 0, None

    def reserve(self, n):
        offset, self.num_elements = self.num_elements, self.num_elements + n
        return offset

    def init(self, device):
        self.data = torch.zeros(self.num_elements, dtype=DTYPE, device=device)

    def replace_buffer_with(self, other):
        self.data = other.data

    def get_num_elements(self):
        return self.num_elements


class Tensor:
    """A row-major (``TensorFormat_t::HW``) tensor living at an offset of a general buffer."""

    def __init__(self, dims, buff):
        self.dims, self.buff = tuple(dims), buff
        self.numel = 1
        for d in self.dims:
            self.numel *= d
        self.offset = buff.reserve(self.numel)

    def get_ptr(self):
        return self.buff.data[self.offset:self.offset + self.numel].view(self.dims)

    def get_dims(self):
        return self.dims

    def get_num_elements(self):
        return self.numel


# --- layers --------------------------------------------------------------------------------------------------------

class Layer:
    def __init__(self, device_id):
        self.device_id_ = device_id
        self.in_tensors_, self.out_tensors_ = [], []

    def inference(self, stream):
        self.fprop(stream)


class FullyConnectedLayer(Layer):
    def __init__(self, weight_buff, wgrad_buff, in_tensor, out_tensor, device_id):
        super().__init__(device_id)
        k, n = in_tensor.get_dims()[1], out_tensor.get_dims()[1]
        self.weights_ = [Tensor((k, n), weight_buff), Tensor((1, n), weight_buff)]
        self.wgrad_ = [Tensor((k, n), wgrad_buff), Tensor((1, n), wgrad_buff)]
        self.in_tensors_.append(in_tensor)
        self.out_tensors_.append(out_tensor)

    def fprop(self, stream):
        inp, out = self.in_tensors_[0].get_ptr(), self.out_tensors_[0].get_ptr()
        weight, bias = self.weights_[0].get_ptr(), self.weights_[1].get_ptr()
        torch.matmul(inp, weight, out=out)                      # cublasGemmEx, beta = 0
        out.add_(bias)                                          # add_bias

    def bprop(self, stream):
        inp, out = self.in_tensors_[0].get_ptr(), self.out_tensors_[0].get_ptr()
        weight = self.weights_[0].get_ptr()
        wgrad, bias_grad = self.wgrad_[0].get_ptr(), self.wgrad_[1].get_ptr()
        wgrad.add_(inp.t() @ out)                               # gradient respect to W, beta_w = 1
        bias_grad.add_(out.sum(dim=0, keepdim=True))            # cal_bias_grad
        inp.copy_(out @ weight.t())                             # gradient respect to Xn, beta_x = 0, in place


class ReluLayer(Layer):
    def __init__(self, in_tensor, out_tensor, device_id):
        super().__init__(device_id)
        self.in_tensors_.append(in_tensor)
        self.out_tensors_.append(out_tensor)

    def fprop(self, stream):
        inp, out = self.in_tensors_[0].get_ptr(), self.out_tensors_[0].get_ptr()
        out.copy_(torch.where(inp < 0, torch.zeros_like(inp), inp))

    def bprop(self, stream):
        inp, out = self.in_tensors_[0].get_ptr(), self.out_tensors_[0].get_ptr()
        inp.copy_(torch.where(inp < 0, torch.zeros_like(out), out))


class DropoutLayer(Layer):
    def __init__(self, in_tensor, out_tensor, rate, curand_generator, device_id, device):
        super().__init__(device_id)
        self.rate_, self.scale_ = rate, 1.0 / (1.0 - rate)
        self.curand_generator_ = curand_generator
        self.in_tensors_.append(in_tensor)
        self.out_tensors_.append(out_tensor)
        self.mask_ = torch.zeros(in_tensor.get_dims(), dtype=DTYPE, device=device)    # cudaMalloc(&mask_)
        curandSetPseudoRandomGeneratorSeed(self.curand_generator_, self.get_seed())

    def get_seed(self):
        return 20200701                       # /dev/urandom upstream; fixed so both runs draw the same masks

    def fprop(self, stream):
        if _variant == "fix":
            curandSetStream(self.curand_generator_, stream)
        curandGenerateUniform(self.curand_generator_, self.mask_, self.in_tensors_[0].get_num_elements())
        self.prop_common(self.in_tensors_[0].get_ptr(), self.out_tensors_[0].get_ptr(), stream)

    def bprop(self, stream):
        self.prop_common(self.out_tensors_[0].get_ptr(), self.in_tensors_[0].get_ptr(), stream)

    def inference(self, stream):
        self.out_tensors_[0].get_ptr().copy_(self.in_tensors_[0].get_ptr())      # cudaMemcpyAsync D2D

    def prop_common(self, inp, out, stream):
        # dropout_kernel: out[i] = ((1.f - mask[i]) >= rate) * in[i] * scale
        keep = ((1.0 - self.mask_) >= self.rate_).to(DTYPE)
        out.copy_(keep * inp * self.scale_)


# --- loss, regularizer, optimizer ----------------------------------------------------------------------------------

class NoRegularizer:
    def __init__(self, wgrad_buff):
        self.wgrad_buff_ = wgrad_buff

    def compute_rterm(self, stream):
        pass

    def get_rterm(self):
        return 0.0

    def initialize_wgrad(self, stream):
        self.wgrad_buff_.data.zero_()                           # initialize_array(wgrad, n, 0)


class BinaryCrossEntropyLoss:
    def __init__(self, label_tensor, input_tensor, loss_tensor, regularizer, device_id, total_gpu_count, scaler):
        self.label_tensors_, self.input_tensors_, self.loss_tensors_ = [label_tensor], [input_tensor], [loss_tensor]
        self.regularizer_, self.total_gpu_count_, self.scaler_ = regularizer, total_gpu_count, scaler

    def compute(self, is_train, stream):
        inp = self.input_tensors_[0].get_ptr()
        label = self.label_tensors_[0].get_ptr()
        loss = self.loss_tensors_[0].get_ptr()
        batch_size = inp.shape[0]
        rterm = 0.0
        if self.regularizer_:
            self.regularizer_.compute_rterm(stream)
            rterm = self.regularizer_.get_rterm()
        self.do_compute(inp, label, loss, batch_size, rterm, is_train)
        if is_train and self.regularizer_:
            self.regularizer_.initialize_wgrad(stream)

    def do_compute(self, x, y, loss, batch_size, rterm, is_train):
        # BinaryCrossEntropy_Kernel: the loss, and the gradient (train) or probability (eval) written into x
        pos = x >= 0
        exp_neg_x = exp_x = torch.exp(-x.abs())                 # exp(-x) where x >= 0, exp(x) where x < 0
        l_pos = x * (1 - y) + torch.log1p(exp_neg_x)
        l_neg = -x * y + torch.log1p(exp_x)
        loss.view(-1)[0] = torch.where(pos, l_pos, l_neg).sum() / batch_size + rterm
        if is_train:
            g_pos = ((1 - y) - exp_neg_x / (1 + exp_neg_x)) * self.scaler_ / batch_size / self.total_gpu_count_
            g_neg = (-y + exp_x / (1 + exp_x)) * self.scaler_ / batch_size / self.total_gpu_count_
            x.copy_(torch.where(pos, g_pos, g_neg))
        else:
            x.copy_(torch.where(pos, 1 / (1 + exp_neg_x), exp_x / (exp_x + 1)))


class MomentumSGD:
    def __init__(self, weight_buff, wgrad_buff, device_id, lr, momentum_factor, scaler, device):
        self.weight_, self.wgrad_ = weight_buff, wgrad_buff
        self.lr_, self.momentum_factor_, self.scaler_ = lr, momentum_factor, scaler
        self.momentum_ = torch.zeros(weight_buff.get_num_elements(), dtype=DTYPE, device=device)

    def update(self, stream):
        # momentumSGD_update_kernel
        self.momentum_.mul_(self.momentum_factor_).sub_(self.lr_ * self.wgrad_.data / self.scaler_)
        self.weight_.data.add_(self.momentum_)


# --- src/network.cu ------------------------------------------------------------------------------------------------

class Network:
    def __init__(self, device_id, gpu_resource, full_fp16=False):
        self.layers_ = []
        self.blobs_buff_, self.weight_buff_, self.wgrad_buff_ = GeneralBuffer(), GeneralBuffer(), GeneralBuffer()
        self.gpu_resource_, self.device_id_, self.full_fp16_ = gpu_resource, device_id, full_fp16
        self.optimizer_ = self.loss_ = self.loss_tensor_ = None
        self.raw_metrics_ = {}
        self.input_tensors_ = {}
        self.enable_cuda_graph_ = True
        self.eval_graph_created_ = self.train_fprop_graph_created_ = self.train_bprop_graph_created_ = False
        self.train_fprop_instance_ = self.train_bprop_instance_ = self.eval_instance_ = None
        self.train_fprop_outputs_ = self.train_bprop_outputs_ = self.eval_outputs_ = None

    def set_weight(self, weight_buff):
        self.weight_buff_.replace_buffer_with(weight_buff)

    def get_weight(self):
        return self.weight_buff_

    def _state(self):
        return {"weight_buff_": self.weight_buff_.data, "wgrad_buff_": self.wgrad_buff_.data,
                "blobs_buff_": self.blobs_buff_.data}

    def _capture(self, fn, name):
        """cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed) ... cudaStreamEndCapture,
        cudaGraphInstantiate: no warmup."""
        static = {name_: t.get_ptr() for name_, t in self.input_tensors_.items()}
        return capture(fn, device=self.gpu_resource_.device, warmups=0, owner="Network", name=name,
                       static=static, state=self._state())

    def _fprop(self):
        stream = self.gpu_resource_.get_stream()
        for layer in self.layers_:
            layer.fprop(stream)
        return self.raw_metrics_["Pred"].get_ptr()

    def _bprop(self):
        stream = self.gpu_resource_.get_stream()
        for layer in reversed(self.layers_):
            layer.bprop(stream)
        return self.wgrad_buff_.data

    def _inference(self):
        stream = self.gpu_resource_.get_stream()
        for layer in self.layers_:
            layer.inference(stream)
        return self.raw_metrics_["Pred"].get_ptr()

    def train(self):
        stream = self.gpu_resource_.get_stream()
        if self.enable_cuda_graph_:
            if not self.train_fprop_graph_created_:
                self.train_fprop_instance_, self.train_fprop_outputs_ = self._capture(self._fprop, "train fprop")
                self.train_fprop_graph_created_ = True
            replay(self.train_fprop_instance_, self.train_fprop_outputs_)              # cudaGraphLaunch
        else:
            self._fprop()

        self.loss_.compute(True, stream)

        if self.enable_cuda_graph_:
            if not self.train_bprop_graph_created_:
                self.train_bprop_instance_, self.train_bprop_outputs_ = self._capture(self._bprop, "train bprop")
                self.train_bprop_graph_created_ = True
            replay(self.train_bprop_instance_, self.train_bprop_outputs_)
        else:
            self._bprop()

    def eval(self):
        stream = self.gpu_resource_.get_stream()
        if self.enable_cuda_graph_:
            if not self.eval_graph_created_:
                self.eval_instance_, self.eval_outputs_ = self._capture(self._inference, "eval")
                self.eval_graph_created_ = True
            replay(self.eval_instance_, self.eval_outputs_)
        else:
            self._inference()
        self.loss_.compute(False, stream)

    def update_params(self):
        self.optimizer_.update(self.gpu_resource_.get_stream())

    def get_loss(self):
        return self.loss_tensor_.get_ptr().clone()


# --- src/parser.cpp ------------------------------------------------------------------------------------------------

LAYERS = [
    {"type": "InnerProduct", "bottom": "dense", "top": "fc1", "num_output": HIDDEN},
    {"type": "ReLU", "bottom": "fc1", "top": "relu1"},
    {"type": "Dropout", "bottom": "relu1", "top": "dropout1", "rate": DROPOUT_RATE},
    {"type": "InnerProduct", "bottom": "dropout1", "top": "fc2", "num_output": 1},
    {"type": "BinaryCrossEntropyLoss", "bottom": ["fc2", "label"], "top": "loss"},
]


def create_network(j_array, tensor_list_in, device_id, num_networks_in_global, gpu_resource, scaler):
    network = Network(device_id, gpu_resource)
    tensor_list = dict(tensor_list_in)
    layers, device = network.layers_, gpu_resource.device
    for j in j_array:
        kind = j["type"]
        if kind == "InnerProduct":
            in_tensor = tensor_list[j["bottom"]]
            out_tensor = Tensor((in_tensor.get_dims()[0], j["num_output"]), network.blobs_buff_)
            layers.append(FullyConnectedLayer(network.weight_buff_, network.wgrad_buff_, in_tensor, out_tensor,
                                              device_id))
            tensor_list[j["top"]] = out_tensor
        elif kind == "ReLU":
            in_tensor = tensor_list[j["bottom"]]
            out_tensor = Tensor(in_tensor.get_dims(), network.blobs_buff_)
            layers.append(ReluLayer(in_tensor, out_tensor, device_id))
            tensor_list[j["top"]] = out_tensor
        elif kind == "Dropout":
            do_in_tensor = tensor_list[j["bottom"]]
            do_out_tensor = Tensor(do_in_tensor.get_dims(), network.blobs_buff_)
            rate = j.get("rate", 0.5)
            layers.append(DropoutLayer(do_in_tensor, do_out_tensor, rate, gpu_resource.get_curand_generator(),
                                       device_id, device))
            if _variant == "fix":
                network.enable_cuda_graph_ = False
            tensor_list[j["top"]] = do_out_tensor
        elif kind == "BinaryCrossEntropyLoss":
            pred, label = (tensor_list[b] for b in j["bottom"])
            network.loss_tensor_ = Tensor((1, 1), network.blobs_buff_)
            network.loss_ = BinaryCrossEntropyLoss(label, pred, network.loss_tensor_,
                                                   NoRegularizer(network.wgrad_buff_), device_id,
                                                   num_networks_in_global, scaler)
            network.raw_metrics_ = {"Loss": network.loss_tensor_, "Pred": pred, "Label": label}
    network.optimizer_ = MomentumSGD(network.weight_buff_, network.wgrad_buff_, device_id, LR, MOMENTUM_FACTOR,
                                     scaler, device)
    network.weight_buff_.init(device)
    network.wgrad_buff_.init(device)
    network.blobs_buff_.init(device)
    network.input_tensors_ = dict(tensor_list_in)            # the data reader's buffers the first layer reads
    return network


class DataReader:
    """The data reader's device buffers: a dense input and a label of one batch, refreshed in place."""

    def __init__(self, device):
        self.buff = GeneralBuffer()
        self.dense = Tensor((BATCH, DENSE_DIM), self.buff)
        self.label = Tensor((BATCH, 1), self.buff)
        self.buff.init(device)
        self.batches, self.cursor = [], 0

    def read_a_batch_to_device(self):
        dense, label = self.batches[self.cursor % len(self.batches)]
        self.cursor += 1
        self.dense.get_ptr().copy_(dense)
        self.label.get_ptr().copy_(label)

    def tensor_map(self):
        return {"dense": self.dense, "label": self.label}


# --- src/session.cpp -----------------------------------------------------------------------------------------------

class Session:
    def __init__(self, device, use_cuda_graph):
        gen = generator(0xDDF7F0F)
        self.data_reader_, self.data_reader_eval_ = DataReader(device), DataReader(device)
        for reader, n in ((self.data_reader_, TRAIN_ITERS), (self.data_reader_eval_, EVAL_BATCHES)):
            for _ in range(n):
                dense = randn(BATCH, DENSE_DIM, gen=gen, device=device).to(DTYPE)
                label = (torch.rand(BATCH, 1, generator=gen, dtype=DTYPE) > 0.5).to(DTYPE).to(device)
                reader.batches.append((dense, label))
        gpu_resource = GPUResource(0, device)
        self.networks_, self.networks_eval_ = [], []
        # Parser::create_pipeline: one train and one eval network per GPU, the eval one on the train weights
        self.networks_.append(create_network(LAYERS, self.data_reader_.tensor_map(), 0, 1, gpu_resource, SCALER))
        self.networks_eval_.append(create_network(LAYERS, self.data_reader_eval_.tensor_map(), 0, 1, gpu_resource,
                                                  SCALER))
        self.networks_eval_[-1].set_weight(self.networks_[-1].get_weight())
        self.networks_[0].get_weight().data.copy_(                                     # init_params
            randn(self.networks_[0].get_weight().get_num_elements(), gen=gen, device=device, scale=0.5).to(DTYPE))
        if not use_cuda_graph:                                   # the reference: the same session without graphs
            for n in self.networks_ + self.networks_eval_:
                n.enable_cuda_graph_ = False

    def train(self):
        self.data_reader_.read_a_batch_to_device()
        self.networks_[0].train()
        self.networks_[0].update_params()

    def eval(self):
        self.data_reader_eval_.read_a_batch_to_device()
        self.networks_eval_[0].eval()


def _run(device, use_cuda_graph):
    session = Session(device, use_cuda_graph)
    losses = []
    for _ in range(TRAIN_ITERS):
        session.train()
        losses.append(session.networks_[0].get_loss())
    eval_losses, preds = [], []
    for _ in range(EVAL_BATCHES):
        session.eval()
        eval_losses.append(session.networks_eval_[0].get_loss())
        preds.append(session.networks_eval_[0].raw_metrics_["Pred"].get_ptr().clone())
    return [torch.cat(losses), session.networks_[0].get_weight().data.clone(), torch.cat(eval_losses),
            torch.cat(preds)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _run(device, use_cuda_graph=True),
                       lambda: _run(device, use_cuda_graph=False))
