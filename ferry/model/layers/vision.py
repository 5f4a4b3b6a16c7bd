"""Qwen3-VL's vision tower (torch, prefill only): one image's patches in, its merged tokens out.

The patch embedding is a Conv3d whose stride equals its kernel, i.e. a linear map of each
flattened (channels, frames, rows, columns) patch; learned position embeddings on a square grid,
bilinearly resampled (corners aligned) to the image's grid; ViT blocks (LayerNorm, full attention
with 2-D rope over each patch's (row, column), GELU-tanh MLP); the patch merger (LayerNorm, then
each 2x2 group of patches as one row, a GELU MLP to the language model's width); and the
deepstack mergers, whose outputs of chosen blocks are added to the first language layers' image
rows. Patches arrive in merge-block order (the image processor's), so merged row k is the k-th
image token in raster order of the merged grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ferry.model.encoding import PIECE_ROWS, Pieces, row_spans, shares


@dataclass
class VisionOutput:
    """One image's rows for the language model: the merged tokens and the deepstack features."""

    embeds: torch.Tensor  # [tokens, hidden]
    deepstack: list[torch.Tensor]  # one [tokens, hidden] per deepstack layer, in layer order


@dataclass
class _Merger:
    norm: tuple[torch.Tensor, torch.Tensor]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]
    postshuffle: bool  # the norm runs over the grouped row (deepstack) or each patch (the main merger)

    def forward(self, x: torch.Tensor, group: int) -> torch.Tensor:
        width = x.shape[-1] * group
        if self.postshuffle:
            x = F.layer_norm(x.reshape(-1, width), (width,), *self.norm, eps=1e-6)
        else:
            x = F.layer_norm(x, (x.shape[-1],), *self.norm, eps=1e-6).reshape(-1, width)
        return F.linear(F.gelu(F.linear(x, *self.fc1)), *self.fc2)


class Qwen3VLVision:
    """The tower of a Qwen3-VL checkpoint: config.json's vision_config and the model.visual. tensors."""

    def __init__(self, vc: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        def t(name: str) -> torch.Tensor:
            return tensors[f"model.visual.{name}"].to(device=device, dtype=dtype)

        def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return t(f"{name}.weight"), t(f"{name}.bias")

        self.dtype, self.device = dtype, device
        self.hidden = vc["hidden_size"]
        self.heads = vc["num_heads"]
        self.merge = vc.get("spatial_merge_size", 2)
        self.patch_w, self.patch_b = pair("patch_embed.proj")
        self.patch_w = self.patch_w.reshape(self.hidden, -1)  # the conv's kernel as one product
        self.pos_embed = t("pos_embed.weight")
        self.side = int(self.pos_embed.shape[0] ** 0.5)
        theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        quarter = self.hidden // self.heads // 2  # rows and columns take half a head each
        self.inv_freq = 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.blocks = [{n: pair(f"blocks.{i}.{n}") for n in ("norm1", "norm2", "attn.qkv", "attn.proj",
                                                               "mlp.linear_fc1", "mlp.linear_fc2")}
                       for i in range(vc["depth"])]
        self.merger = _Merger(pair("merger.norm"), pair("merger.linear_fc1"), pair("merger.linear_fc2"), False)
        self.deepstack_layers = list(vc.get("deepstack_visual_indexes") or [])
        self.deepstack = [_Merger(pair(f"deepstack_merger_list.{k}.norm"), pair(f"deepstack_merger_list.{k}.linear_fc1"),
                                  pair(f"deepstack_merger_list.{k}.linear_fc2"), True)
                          for k in range(len(self.deepstack_layers))]
        # The most patch rows one piece of a block takes (the encoder's unit of work between steps).
        self.piece_rows = PIECE_ROWS

    def _block_order(self, grid: torch.Tensor) -> torch.Tensor:
        """[h * w] flat raster indices of a (h, w) grid in merge-block order."""
        h, w, m = grid.shape[0], grid.shape[1], self.merge
        return grid.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)

    def _positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned position embeddings resampled to an (h, w) grid, in merge-block order, per frame."""
        side = self.side

        def taps(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
            lo = src.floor()
            return lo.long(), (lo.long() + 1).clamp(max=side - 1), src - lo

        h0, h1, dh = taps(h)
        w0, w1, dw = taps(w)
        table = self.pos_embed
        out = 0
        for hi, hw in ((h0, 1 - dh), (h1, dh)):
            for wi, ww in ((w0, 1 - dw), (w1, dw)):
                idx = hi[:, None] * side + wi[None, :]
                out = out + table[idx.to(self.device)] * (hw[:, None] * ww[None, :]).to(self.device, self.dtype)[..., None]
        order = self._block_order(torch.arange(h * w).reshape(h, w))
        return out.reshape(h * w, -1)[order.to(self.device)].repeat(t, 1)

    def _rotation(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, 1, head_dim]: each patch's (row, column) rope, in merge-block order."""
        rows = self._block_order(torch.arange(h)[:, None].expand(h, w))
        cols = self._block_order(torch.arange(w)[None, :].expand(h, w))
        freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1).repeat(t, 1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None].to(self.device), emb.sin()[:, None].to(self.device)

    def _heads(self, x: torch.Tensor, blk: dict[str, Any], cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [heads, patches, head_dim] of a block's normed input, q and k turned by the 2-D rope."""
        n, hd = x.shape[0], self.hidden // self.heads
        q, k, v = F.linear(x, *blk["attn.qkv"]).reshape(n, 3, self.heads, hd).unbind(1)

        def rope(z: torch.Tensor) -> torch.Tensor:
            zf = z.float()
            rotated = torch.cat((-zf[..., hd // 2:], zf[..., :hd // 2]), dim=-1)
            return (zf * cos + rotated * sin).to(z.dtype)

        return tuple(z.transpose(0, 1).contiguous() for z in (rope(q), rope(k), v))  # type: ignore[return-value]

    def _rows(self, x: torch.Tensor, lo: int, hi: int, blk: dict[str, Any],
              qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """The rest of a block for rows [lo, hi) of ``x``, in place: their attention over every
        patch, the projection and the MLP, each with its residual."""
        q, k, v = qkv
        scores = torch.matmul(q[:, lo:hi], k.transpose(1, 2)) * (self.hidden // self.heads) ** -0.5
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        o = torch.matmul(probs, v).transpose(0, 1).reshape(hi - lo, self.hidden)
        y = x[lo:hi] + F.linear(o, *blk["attn.proj"])
        mid = F.layer_norm(y, (self.hidden,), *blk["norm2"], eps=1e-6)
        x[lo:hi] = y + F.linear(F.gelu(F.linear(mid, *blk["mlp.linear_fc1"]), approximate=self.approximate),
                                *blk["mlp.linear_fc2"])

    @torch.inference_mode()
    def encode_pieces(self, pixel_values: torch.Tensor, grid_thw: Any) -> Pieces:
        """One image: its processed patches [patches, channels * frames * patch * patch] and its
        (t, h, w) patch grid -> its token rows and deepstack features, as pieces
        (``ferry.model.encoding``): the embedding; per block its projections, then its rows in
        chunks of at most ``piece_rows``; each deepstack merger; the merger."""
        t, h, w = (int(v) for v in grid_thw)
        x = F.linear(pixel_values.to(self.device, self.dtype).reshape(-1, self.patch_w.shape[1]),
                     self.patch_w, self.patch_b)
        spans = row_spans(x.shape[0], self.piece_rows)
        done = iter(shares(2 + len(self.blocks) * (1 + len(spans)) + len(self.deepstack)))
        x = x + self._positions(t, h, w)
        cos, sin = self._rotation(t, h, w)
        group = self.merge ** 2
        deepstack = []
        yield next(done)
        for i, blk in enumerate(self.blocks):
            qkv = self._heads(F.layer_norm(x, (self.hidden,), *blk["norm1"], eps=1e-6), blk, cos, sin)
            yield next(done)
            for lo, hi in spans:
                self._rows(x, lo, hi, blk, qkv)
                yield next(done)
            if i in self.deepstack_layers:
                deepstack.append(self.deepstack[self.deepstack_layers.index(i)].forward(x, group))
                yield next(done)
        merged = self.merger.forward(x, group)
        yield next(done)
        return VisionOutput(merged, deepstack)
