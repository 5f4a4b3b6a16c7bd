"""The C row operations of prefill steps (norm, rope, gated activation) against torch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferry.model.kernels import load_kernels
from ferry.model.layers.rope import apply_rope, rope_tables
from ferry.model.row_ops import gated_act_rows, rms_norm_rows, rope_rows_


@pytest.fixture(autouse=True)
def _kernels():
    if load_kernels() is None:
        pytest.fail("the kernels could not be built (no C compiler?)")


@pytest.mark.parametrize("T,H", [(1, 8), (17, 576), (64, 100)])
def test_rms_norm_rows_is_torchs_on_strided_rows(T, H):
    g = torch.Generator().manual_seed(T * H)
    wide, w = torch.randn(T, H + 7, generator=g) * 3, torch.randn(H, generator=g)
    x = wide[:, 3:3 + H]  # rows H + 7 floats apart
    torch.testing.assert_close(rms_norm_rows(x, w, 1e-5), F.rms_norm(x, (H,), w, 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rms_norm_rows(x.t().contiguous().t(), w, 1e-5), F.rms_norm(x, (H,), w, 1e-5),
                               rtol=1e-5, atol=1e-6)  # a transposed product's output


@pytest.mark.parametrize("heads,D", [(12, 64), (3, 40), (2, 128), (5, 6)])
def test_rope_rows_rotates_as_apply_rope(heads, D):
    """Half-heads that are and are not a multiple of the vector width, rows wider than the rotated
    heads (qkv: v follows q and k, untouched), positions out of order."""
    T, extra = 33, 2 * D
    g = torch.Generator().manual_seed(heads * D)
    cos, sin = rope_tables(D, 10000.0, None, 4096, 4096)
    qkv = torch.randn(T, heads * D + extra, generator=g)
    positions = torch.randperm(300, generator=g)[:T].to(torch.int64)
    want = apply_rope(qkv[:, :heads * D].view(T, heads, D), cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    got = qkv.clone()
    rope_rows_(got, heads, D, cos, sin, positions)
    torch.testing.assert_close(got[:, :heads * D].view(T, heads, D), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, heads * D:], qkv[:, heads * D:])


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("T,I", [(1, 7), (20, 1536), (3, 100)])
def test_gated_act_rows_is_torchs(gelu, T, I):
    g = torch.Generator().manual_seed(T * I)
    gu = torch.randn(T, 2 * I, generator=g) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])[: min(4, I)] if I >= 4 else gu[0, :4]  # saturated ends
    gate, up = gu.chunk(2, dim=-1)
    want = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    torch.testing.assert_close(gated_act_rows(gu, gelu), want, rtol=1e-5, atol=1e-5)
