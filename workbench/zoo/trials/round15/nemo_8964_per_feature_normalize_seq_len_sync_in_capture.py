"""ASR preprocessor ``per_feature`` normalisation slices by ``seq_len[i]``: a host sync inside the capture.

Upstream: https://github.com/NVIDIA/NeMo/pull/8964 ("Fix #8948, allow preprocessor to be stream captured
to a cuda graph when doing per_feature normalization", commit a9dac0edab).
Symptom: stream-capturing the ASR preprocessor (``AudioToMelSpectrogramPreprocessor`` ->
``FilterbankFeatures``) of a model with ``normalize: per_feature`` (Parakeet / FastConformer) fails with
"operation not permitted when stream is capturing"; run eagerly it is correct but slow, the GPU idle
during a per-utterance loop (NeMo 1.23, April 2024; issue #8948 measured ~10 ms per batch of 32).
Mechanism: ``normalize_batch`` loops over the batch and slices ``x[i, :, : seq_len[i]]``: using the
device tensor ``seq_len[i]`` as a slice bound copies it to the host (``cudaStreamSynchronize``) three
times per utterance, and ``FilterbankFeatures.forward`` builds its padding mask with
``torch.arange(max_len).to(x.device)`` (a pageable host-to-device copy). Eagerly both only cost time;
inside a capture the synchronisation is illegal, so no graph of the preprocessor can be made.
Doctor: sync-in-capture, at ``normalize_batch`` (the ``seq_len[i]`` slice bound read on the host).
Fix (upstream): compute the per-feature mean and std for the whole batch at once with a
``time_steps < seq_len`` mask (``torch.where`` and sums on the device), skip the ``seq_len == 1`` check
(its ``.item()``) while the stream is capturing, and create the mask with ``torch.arange(max_len,
device=x.device)``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/NeMo/pull/8964"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "normalize_batch"
SYMPTOM = "capturing the per_feature ASR preprocessor fails: seq_len[i] slice bounds sync with the host"
BATCH, HOP, MAX_FRAMES, N_MELS, D_MODEL = 2, 4, 8, 3, 4
CONSTANT = 1e-5
LOG_ZERO_GUARD = 2 ** -24
# (audio lengths in samples) of the batches served through the preprocessor graph
BATCHES = [[20, 32], [32, 12], [24, 28]]


def normalize_batch(x, seq_len, normalize_type, variant):
    x_mean = None
    x_std = None
    if normalize_type == "per_feature":
        if variant == "bug":
            x_mean = torch.zeros((seq_len.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
            x_std = torch.zeros((seq_len.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
            for i in range(x.shape[0]):
                if x[i, :, : seq_len[i]].shape[1] == 1:
                    raise ValueError(
                        "normalize_batch with `per_feature` normalize_type received a tensor of length 1. "
                        "This will result in torch.std() returning nan.")
                x_mean[i, :] = x[i, :, : seq_len[i]].mean(dim=1)
                x_std[i, :] = x[i, :, : seq_len[i]].std(dim=1)
        else:
            batch_size = x.shape[0]
            max_time = x.shape[2]
            # When doing stream capture to a graph, item() is not allowed because it calls
            # cudaStreamSynchronize(). Therefore, we are sacrificing some error checking when running
            # with cuda graphs.
            if (torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()
                    and torch.any(seq_len == 1).item()):
                raise ValueError(
                    "normalize_batch with `per_feature` normalize_type received a tensor of length 1. "
                    "This will result in torch.std() returning nan.")
            time_steps = torch.arange(max_time, device=x.device).unsqueeze(0).expand(batch_size, max_time)
            valid_mask = time_steps < seq_len.unsqueeze(1)
            x_mean_numerator = torch.where(valid_mask.unsqueeze(1), x, 0.0).sum(axis=2)
            x_mean_denominator = valid_mask.sum(axis=1)
            x_mean = x_mean_numerator / x_mean_denominator.unsqueeze(1)
            # Subtract 1 in the denominator to correct for the bias.
            x_std = torch.sqrt(
                torch.sum(torch.where(valid_mask.unsqueeze(1), x - x_mean.unsqueeze(2), 0.0) ** 2, axis=2)
                / (x_mean_denominator.unsqueeze(1) - 1.0))
        # make sure x_std is not zero
        x_std += CONSTANT
        return (x - x_mean.unsqueeze(2)) / x_std.unsqueeze(2), x_mean, x_std
    return x, x_mean, x_std


class FilterbankFeatures(torch.nn.Module):
    """Framing, a mel filterbank, log, ``per_feature`` normalisation and the padding mask."""

    def __init__(self, device, variant):
        super().__init__()
        gen = generator(8964)
        self.fb = randn(HOP, N_MELS, gen=gen, device=device)
        self.hop_length = HOP
        self.normalize = "per_feature"
        self.pad_value = 0.0
        self.variant = variant

    def get_seq_len(self, seq_len):
        return torch.floor_divide(seq_len + self.hop_length - 1, self.hop_length).to(dtype=torch.long)

    def forward(self, x, seq_len):
        seq_len = self.get_seq_len(seq_len)
        frames = x.view(x.shape[0], -1, self.hop_length)                  # [B, T, hop] (the STFT's frames)
        x = torch.log((frames @ self.fb) ** 2 + LOG_ZERO_GUARD).transpose(1, 2)   # [B, n_mels, T]
        if self.normalize:
            x, _, _ = normalize_batch(x, seq_len, normalize_type=self.normalize, variant=self.variant)
        # mask to zero any values beyond seq_len in batch
        max_len = x.size(-1)
        if self.variant == "bug":
            mask = torch.arange(max_len).to(x.device)
        else:
            mask = torch.arange(max_len, device=x.device)
        mask = mask.repeat(x.size(0), 1) >= seq_len.unsqueeze(1)
        x = x.masked_fill(mask.unsqueeze(1).type(torch.bool).to(device=x.device), self.pad_value)
        return x, seq_len


class EncDecCTCModel:
    """The preprocessor and a one-layer stand-in for the encoder: the graphed part of ``transcribe``."""

    def __init__(self, device, variant):
        gen = generator(8948)
        self.preprocessor = FilterbankFeatures(device, variant)
        self.w_enc = randn(N_MELS, D_MODEL, gen=gen, device=device, scale=0.5)

    def forward(self, input_signal, input_signal_length):
        processed_signal, processed_signal_length = self.preprocessor(input_signal, input_signal_length)
        encoded = processed_signal.transpose(1, 2) @ self.w_enc           # [B, T, d_model]
        valid = torch.arange(encoded.shape[1], device=encoded.device) < processed_signal_length.unsqueeze(1)
        return encoded * valid.unsqueeze(2)


def run(variant: str, device: str = "cpu"):
    model = EncDecCTCModel(device, variant)
    gen = torch.Generator().manual_seed(1)
    audio = [torch.randn(BATCH, HOP * MAX_FRAMES, generator=gen).to(device) for _ in BATCHES]
    lengths = [torch.tensor(b, dtype=torch.long, device=device) for b in BATCHES]
    for a, n in zip(audio, lengths):                                      # the dataloader's zero padding
        a.masked_fill_(torch.arange(a.shape[1], device=device) >= n.unsqueeze(1), 0.0)

    def eager():
        return [model.forward(a, n) for a, n in zip(audio, lengths)]

    def served():
        input_signal = torch.zeros(BATCH, HOP * MAX_FRAMES, device=device)
        input_signal_length = torch.full((BATCH,), HOP * MAX_FRAMES, dtype=torch.long, device=device)
        g, out = capture(lambda: model.forward(input_signal, input_signal_length), device=device,
                         static={"input_signal": input_signal, "input_signal_length": input_signal_length},
                         owner="ASRModel.transcribe (preprocessor + encoder graph)", name=f"batch {BATCH}")
        outs = []
        for a, n in zip(audio, lengths):
            input_signal.copy_(a)
            input_signal_length.copy_(n)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
