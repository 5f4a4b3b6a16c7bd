"""The SigLIP vision transformer (torch, prefill only): square-patch images in, one row per patch out.

Shared by the families whose vision tower is SigLIP's (Idefics3 / SmolVLM, Gemma 3). The layout is
transformers' ``SiglipVisionTransformer`` (and Idefics3's copy of it):

- ``embeddings.patch_embedding``: a Conv2d whose stride equals its kernel, i.e. a linear map of each
  flattened (channels, rows, columns) patch; ``embeddings.position_embedding``: a learned table of
  ``(image_size // patch_size) ** 2`` rows;
- ``encoder.layers.{i}``: pre-LN blocks (``layer_norm1``, full bidirectional attention with biased
  ``self_attn.{q,k,v,out}_proj``, ``layer_norm2``, ``mlp.fc1`` -> gelu-tanh -> ``mlp.fc2``);
- ``post_layernorm``.

API::

    tower = SiglipVision(vision_config, tensors, prefix="model.vision_model.", dtype=..., device=...)
    rows = run_all(tower.encode_pieces(pixel_values, patch_mask=None))  # [B, 3, H, W] -> [B, (H/p) * (W/p), hidden]

``patch_mask`` ([B, H/p, W/p] bool, True where a patch holds image pixels) selects Idefics3's
position ids: each real patch takes the table row of its fractional (row, column) in the image,
bucketed onto the table's grid, so a padded or partial image still spans the whole table; padded
patches take row 0 and are not attended to. Without it, patch k takes row k (plain SigLIP, whose
images are ``image_size`` square). Rows come out in raster order of the patch grid.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ferry.model.encoding import PIECE_ROWS, Pieces, row_spans, shares

_LAYER_TENSORS = ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.out_proj", "mlp.fc1", "mlp.fc2")


def bucketed_position_ids(patch_mask: torch.Tensor, side: int) -> torch.Tensor:
    """[B, h * w] position-table rows of each patch (Idefics3's ``SmolVLMVisionEmbeddings``): a real
    patch's fractional row and column in its image bucketed onto the ``side`` x ``side`` table, padded
    patches row 0. Computed as transformers does, so the float rounding at bucket edges agrees."""
    b, h, w = patch_mask.shape
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    real_h = patch_mask[:, :, 0].sum(dim=1)  # rows of real patches per image
    real_w = patch_mask[:, 0, :].sum(dim=1)
    frac_h = torch.arange(h, dtype=torch.float32)[None, :] * (1.0 / real_h)[:, None]
    frac_w = torch.arange(w, dtype=torch.float32)[None, :] * (1.0 / real_w)[:, None]
    bucket_h = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), boundaries, right=True)
    bucket_w = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), boundaries, right=True)
    ids = (bucket_h[:, :, None] * side + bucket_w[:, None, :]).reshape(b, -1)
    return torch.where(patch_mask.reshape(b, -1), ids, torch.zeros_like(ids))


class SiglipVision:
    """A SigLIP vision tower read from a checkpoint's tensors under ``prefix``.

    ``vc``: the vision config (``hidden_size``, ``num_attention_heads``, ``num_hidden_layers``,
    ``patch_size``, ``image_size``, optional ``layer_norm_eps`` (1e-6) and ``hidden_act``
    (gelu_pytorch_tanh)). ``tensors``: full checkpoint names -> tensors (only ``prefix``'s are read).
    """

    def __init__(self, vc: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str,
                 dtype: torch.dtype, device: torch.device) -> None:
        def t(name: str) -> torch.Tensor:
            return tensors[f"{prefix}{name}"].to(device=device, dtype=dtype)

        def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return t(f"{name}.weight"), t(f"{name}.bias")

        self.dtype, self.device = dtype, device
        self.hidden = int(vc["hidden_size"])
        self.heads = int(vc["num_attention_heads"])
        self.patch = int(vc["patch_size"])
        self.side = int(vc["image_size"]) // self.patch  # the position table's grid side
        self.eps = float(vc.get("layer_norm_eps", 1e-6))
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        self.approximate = "tanh" if act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast") else "none"
        self.patch_w, self.patch_b = pair("embeddings.patch_embedding")
        self.patch_w = self.patch_w.reshape(self.hidden, -1)  # the conv's kernel as one product
        self.pos_embed = t("embeddings.position_embedding.weight")
        self.layers = [{n: pair(f"encoder.layers.{i}.{n}") for n in _LAYER_TENSORS}
                       for i in range(int(vc["num_hidden_layers"]))]
        self.post_norm = pair("post_layernorm") if f"{prefix}post_layernorm.weight" in tensors else None
        self.piece_rows = PIECE_ROWS  # the most patch rows one piece of a layer takes

    def _patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, (H/p) * (W/p), 3 * p * p]: each patch's pixels as the conv reads them."""
        b, c, hh, ww = pixel_values.shape
        p = self.patch
        x = pixel_values.reshape(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (hh // p) * (ww // p), c * p * p)

    def _heads(self, x: torch.Tensor, layer: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, heads, patches, head_dim] of a layer's normed input."""
        b, n, _ = x.shape
        hd = self.hidden // self.heads

        def heads(name: str) -> torch.Tensor:
            return F.linear(x, *layer[name]).reshape(b, n, self.heads, hd).transpose(1, 2).contiguous()

        return heads("self_attn.q_proj"), heads("self_attn.k_proj"), heads("self_attn.v_proj")

    def _rows(self, x: torch.Tensor, lo: int, hi: int, layer: dict[str, Any],
              qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keep: torch.Tensor | None) -> None:
        """The rest of a layer for patch rows [lo, hi) of ``x``, in place: their attention over
        every patch, the output projection and the MLP, each with its residual."""
        q, k, v = qkv
        scores = torch.matmul(q[:, :, lo:hi], k.transpose(-1, -2)) * (self.hidden // self.heads) ** -0.5
        if keep is not None:  # padded patches are no key
            scores = scores.masked_fill(~keep[:, None, None, :], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        o = torch.matmul(probs, v).transpose(1, 2).reshape(x.shape[0], hi - lo, self.hidden)
        y = x[:, lo:hi] + F.linear(o, *layer["self_attn.out_proj"])
        mid = F.layer_norm(y, (self.hidden,), *layer["layer_norm2"], eps=self.eps)
        x[:, lo:hi] = y + F.linear(F.gelu(F.linear(mid, *layer["mlp.fc1"]), approximate=self.approximate),
                                   *layer["mlp.fc2"])

    @torch.inference_mode()
    def encode_pieces(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None = None) -> Pieces:
        """[B, 3, H, W] normalized pixels (H, W multiples of the patch size) -> [B, patches, hidden]
        after the post layernorm, as pieces (``ferry.model.encoding``): the embedding; per layer its
        projections, then its patch rows in chunks of at most ``piece_rows``. ``patch_mask``:
        [B, H/p, W/p] bool (see the module's docstring)."""
        x = F.linear(self._patches(pixel_values.to(self.device, self.dtype)), self.patch_w, self.patch_b)
        b, n = x.shape[:2]
        if patch_mask is None:
            ids = torch.arange(n).expand(b, n)
            keep = None
        else:
            mask = patch_mask.to("cpu", torch.bool)
            ids = bucketed_position_ids(mask, self.side)
            keep = None if bool(mask.all()) else mask.reshape(b, -1).to(self.device)
        spans = row_spans(n, self.piece_rows)
        done = iter(shares(1 + len(self.layers) * (1 + len(spans))))
        x = x + self.pos_embed[ids.to(self.device)]
        yield next(done)
        for layer in self.layers:
            qkv = self._heads(F.layer_norm(x, (self.hidden,), *layer["layer_norm1"], eps=self.eps), layer)
            yield next(done)
            for lo, hi in spans:
                self._rows(x, lo, hi, layer, qkv, keep)
                yield next(done)
        if self.post_norm is not None:
            x = F.layer_norm(x, (self.hidden,), *self.post_norm, eps=self.eps)
        return x


def patch_mask_from_pixels(pixel_mask: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, H, W] pixel mask (1: image, 0: padding) -> [B, H/p, W/p] bool: a patch is real where any
    of its pixels is (transformers' Idefics3 rule)."""
    b, hh, ww = pixel_mask.shape
    return pixel_mask.reshape(b, hh // patch, patch, ww // patch, patch).sum(dim=(2, 4)) > 0
