"""The recurrent layers' prefill helpers (layers/recurrent.py's convolution, gated_deltanet.py's
chunked delta rule), torch and C (kernels/recurrent_prefill.c), against plain references: the
depthwise F.conv1d over the window and the chunk, and the delta rule token by token in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferry.model.kernels import load_kernels
from ferry.model.layers.gated_deltanet import CHUNK, delta_rule_chunks, delta_rule_kernel, recurrent_step
from ferry.model.layers.recurrent import conv_prefill

KERNELS = [False] + ([True] if load_kernels() is not None else [])


def conv_reference(x, weight, bias, window, silu):
    """transformers' form: F.conv1d over [channels, window + chunk]; the new window its last K - 1 inputs."""
    xp = torch.cat([window, x])
    y = F.conv1d(xp.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=x.shape[1])[0].t()
    return (F.silu(y) if silu else y), xp[xp.shape[0] - (weight.shape[1] - 1):]


@pytest.mark.parametrize("use_kernel", KERNELS)
@pytest.mark.parametrize("T,C,K", [(1, 70, 4), (2, 37, 4), (3, 64, 4), (45, 6 * 16 + 5, 3), (20, 24, 2)])
def test_conv_prefill_is_the_depthwise_conv1d(use_kernel, T, C, K):
    """Chunks shorter than the window (the new window keeps part of the old), channels that are and
    are not a multiple of the vector width, rows strided and transposed (a product's output), with
    and without bias and SiLU, into a given output row-major or not."""
    g = torch.Generator().manual_seed(T * C + K)
    weight, bias = torch.randn(C, K, generator=g), torch.randn(C, generator=g)
    window = torch.randn(K - 1, C, generator=g)
    x = torch.randn(T, C + 9, generator=g)[:, 4:4 + C]
    for silu in (False, True):
        for b in (None, bias):
            want_y, want_w = conv_reference(x, weight, b, window, silu)
            for rows, out in ((x, torch.empty(T, C)), (x.t().contiguous().t(), torch.empty(C, T).t())):
                y, w = conv_prefill(rows, weight, b, window, silu, use_kernel=use_kernel, out=out)
                assert y.data_ptr() == out.data_ptr()
                torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(w, want_w, rtol=0, atol=0)


def recurrence(q, k, v, g, beta, state):
    """The delta rule token by token (recurrent_step), token-major inputs, float64."""
    outs = []
    for t in range(q.shape[0]):
        o, state = recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(o)
    return torch.cat(outs), state[0]


def inputs(T, hk, H, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(T, H, dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 2
    beta = torch.rand(T, H, generator=g)
    return q, k, v, decay, beta, torch.randn(H, dk, dv, generator=g)


@pytest.mark.parametrize("T,dk,dv", [(1, 8, 12), (CHUNK + 1, 8, 12), (2 * CHUNK + 37, 32, 48), (CHUNK, 16, 40)])
def test_the_chunked_delta_rule_equals_its_recurrence(T, dk, dv):
    """Token-major, from a carried state, into a given output: blocks whole and partial (torch, float64)."""
    q, k, v, decay, beta, state = (x.double() for x in inputs(T, 3, 3, dk, dv, T))
    q, k = F.normalize(q, dim=-1) * dk ** -0.5, F.normalize(k, dim=-1)
    want, want_state = recurrence(q, k, v, decay, beta, state[None])
    out = torch.empty(T, 3, dv, dtype=torch.float64)
    got, got_state = delta_rule_chunks(q, k, v, decay, beta, state, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_state, want_state, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(load_kernels() is None, reason="no C kernels here")
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("T,hk,H,dk,dv", [(1, 2, 4, 8, 12), (CHUNK + 3, 2, 4, 8, 12), (2 * CHUNK + 37, 1, 2, 32, 48),
                                          (CHUNK, 2, 2, 128, 128)])
def test_the_kernel_equals_the_recurrence(tiled, T, hk, H, dk, dv):
    """The C chunks (q, k raw and normed there, each q/k head serving H // hk value heads grouped or
    tiled, rows strided as in the layer's convolved rows, the state updated in place) give the
    float64 recurrence's outputs and state within float32 rounding."""
    q, k, v, decay, beta, state = inputs(T, hk, H, dk, dv, T + H)
    rows = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1), torch.zeros(T, 5)], 1)  # strided, as the layer's
    kd = hk * dk
    qs, ks, vs = rows[:, :kd].view(T, hk, dk), rows[:, kd:2 * kd].view(T, hk, dk), rows[:, 2 * kd:-5].view(T, H, dv)
    heads = torch.arange(H) % hk if tiled else torch.arange(H) // (H // hk)
    qn, kn = (F.normalize(x.double(), dim=-1, eps=0)[:, heads] for x in (q, k))
    want, want_state = recurrence(qn * dk ** -0.5, kn, v.double(), decay.double(), beta.double(), state.double()[None])
    out, slot = torch.empty(T, H, dv), state.clone()
    delta_rule_kernel(qs, ks, vs, decay, beta, slot, slot, out, norm=True, tiled=tiled)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(slot.double(), want_state, rtol=1e-4, atol=2e-5)


def subnormal_survives() -> bool:
    """Whether this thread computes subnormal floats (no flush-to-zero in force)."""
    return bool((torch.tensor([1e-37]) / torch.tensor([1e3])).item() != 0.0)


@pytest.mark.skipif(load_kernels() is None, reason="no C kernels here")
def test_strong_decays_give_the_recurrence_and_leave_the_callers_float_mode():
    """Decays of -40 a token (random gates reach them) drive the chunk's products under FLT_MIN, where
    the kernels flush to zero for speed: outputs and state stay the float64 recurrence's, and the
    calling thread computes subnormals afterwards as before."""
    T, H, d = 2 * CHUNK + 5, 4, 32
    q, k, v, _, beta, state = inputs(T, H, H, d, d, 11)
    decay = -40 * torch.rand(T, H, generator=torch.Generator().manual_seed(12))
    qn, kn = (F.normalize(x.double(), dim=-1, eps=0) for x in (q, k))
    want, want_state = recurrence(qn * d ** -0.5, kn, v.double(), decay.double(), beta.double(), state.double()[None])
    assert subnormal_survives()
    out, slot = torch.empty(T, H, d), state.clone()
    delta_rule_kernel(q, k, v, decay, beta, slot, slot, out, norm=True)
    assert subnormal_survives()
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(slot.double(), want_state, rtol=1e-4, atol=2e-5)
