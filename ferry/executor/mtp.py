"""Qwen3.5's multi-token prediction (MTP) head, as vLLM's qwen3_5_mtp / qwen3_next_mtp run it: a
draft of one decoder layer that reads the target's own last hidden states.

At position ``p`` the head takes the target's final normed hidden state ``h_p`` and the embedding
``e`` of token ``p + 1`` (the target's embedding table) and predicts token ``p + 2``::

    x = fc(concat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h_p)))   # [2 * hidden] -> [hidden]
    x = layer(x)               # one full-attention decoder layer (gated attention + MLP), own KV
    h' = norm(x)               # the head's final norm; logits = lm_head(h') (the target's LM head)

Every norm is Qwen3.5's (1 + w). Drafting ``k`` tokens applies the head ``k`` times, each time on
its own ``h'`` and the token it just proposed, one position further (vLLM's recursion; with
several MTP layers, step ``j`` runs layer ``j mod layers``).

The checkpoint keeps it under ``mtp.*`` (transformers' Qwen3_5ForCausalLM ignores those):
``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and
``mtp.layers.{i}.*`` named as the model's own layers. llama.cpp's converter (``--mtp``) writes the
head as a GGUF of its own: ``blk.{n}.nextn.{eh_proj,enorm,hnorm,shared_head_norm}`` and the layer's
tensors at block ``n`` (the target's layer count), read by ``mtp_tensors_from_gguf``.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ferry.model.config import ModelConfig
from ferry.model.decoder import DecoderModel
from ferry.model.layers.linear import linear
from ferry.model.layers.norm import rms_norm
from ferry.model.weights import unfuse

MTP_ARCHITECTURES = {"Qwen3_5ForCausalLM": "Qwen3_5ForCausalLM",
                     "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                     "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForCausalLM",
                     "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
# llama.cpp's nextn names for the head's own tensors (conversion/qwen.py's _QwenMtpMixin).
GGUF_NEXTN = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
              "shared_head_norm": "norm"}


def mtp_layer_count(tensors: dict[str, Any]) -> int:
    """How many MTP layers the ``mtp.*`` tensors hold."""
    idx = {int(n.split(".")[2]) for n in tensors if n.startswith("mtp.layers.")}
    return max(idx) + 1 if idx else 0


def mtp_tensors_from_gguf(path: str | Path, target: ModelConfig) -> dict[str, Any]:
    """The ``mtp.*`` tensors of llama.cpp's MTP GGUF (``convert_hf_to_gguf.py --mtp``), float32, as
    the checkpoint keeps them (its converter stores every (1 + w) norm as 1 + w)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    first = target.num_layers
    layer_names = target.arch.gguf_layer_names()  # llama.cpp's layer tensor name -> Hugging Face's
    out: dict[str, Any] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or int(parts[1]) < first:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the innermost first
        a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if parts[2] == "nextn":
            name = f"mtp.{GGUF_NEXTN[parts[3]]}.{parts[-1]}"
        else:
            name = f"mtp.layers.{int(parts[1]) - first}.{layer_names['.'.join(parts[2:-1])]}.{parts[-1]}"
        if name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_"):
            a = a - np.float32(target.arch.norm_offset)  # stored as 1 + w
        out[name] = torch.from_numpy(np.array(a, dtype=np.float32))  # a copy: the reader's memory is read-only
    if not out:
        raise ValueError(f"{str(path)!r} holds no MTP head (no block {first} or later): convert it with "
                         "llama.cpp's convert_hf_to_gguf.py --mtp")
    return out


class MTPHead:
    """The head's weights, its decoder layer(s) as a one-layer ``DecoderModel`` sharing the target's
    embedding and LM head, and one forward step."""

    def __init__(self, target_cfg: ModelConfig, tensors: dict[str, Any], target: DecoderModel,
                 dtype: torch.dtype, max_len: int, device: torch.device) -> None:
        arch = MTP_ARCHITECTURES.get(target_cfg.architecture)
        if arch is None:
            raise ValueError(f"speculative_config.method 'mtp': {target_cfg.architecture} has no MTP head "
                             f"ferry reads (it reads {', '.join(sorted(MTP_ARCHITECTURES))})")
        n = mtp_layer_count(tensors)
        missing = [w for w in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
                   if f"mtp.{w}.weight" not in tensors]
        if n == 0 or missing:
            raise ValueError("speculative_config.method 'mtp': the checkpoint has no complete MTP head "
                             f"(mtp.* tensors: {n} layers, missing {', '.join('mtp.' + m for m in missing) or 'none'})")
        full = target_cfg.layers[target_cfg.attention_layers[0]]
        # The layers' own weights under the model's names; a one-row embedding and LM head stand in
        # for the target's, which the head uses (nothing copied).
        h = target_cfg.hidden_size
        cfg = replace(target_cfg, architecture=arch, num_layers=n, layers=(full,) * n, vocab_size=1,
                      tie_word_embeddings=False)
        weights = {"model.layers." + k[len("mtp.layers."):]: v for k, v in tensors.items()
                   if k.startswith("mtp.layers.")}
        weights.update({"model.norm.weight": tensors["mtp.norm.weight"], "model.embed_tokens.weight": torch.zeros(1, h),
                        "lm_head.weight": torch.zeros(1, h)})
        self.model = DecoderModel(cfg, unfuse(weights, cfg), dtype, max_len, device)
        self.model.embed, self.model.lm_head = target.embed, target.lm_head
        self.model.cfg = replace(cfg, vocab_size=target_cfg.vocab_size)
        self.target = target
        self.cfg = self.model.cfg
        self.num_layers = n
        self.eps = target_cfg.rms_norm_eps
        offset = target_cfg.arch.norm_offset  # (1 + w)

        def norm(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=dtype) + offset

        self.enorm, self.hnorm = norm("mtp.pre_fc_norm_embedding.weight"), norm("mtp.pre_fc_norm_hidden.weight")
        fc = tensors["mtp.fc.weight"]
        if tuple(fc.shape) != (h, 2 * h):
            raise ValueError(f"mtp.fc.weight has shape {tuple(fc.shape)}, the head needs {(h, 2 * h)}")
        self.fc = fc.to(device=device, dtype=dtype).contiguous()
        self.use_kernel = self.model.use_kernel

    @classmethod
    def load(cls, model_dir: Path, target_cfg: ModelConfig, target: DecoderModel, dtype: torch.dtype,
             max_len: int, device: torch.device, gguf: str | Path | None = None) -> "MTPHead":
        """The head from the checkpoint's ``mtp.*`` tensors, or from llama.cpp's MTP GGUF ``gguf``."""
        from ferry.model.loader import load_safetensors

        if gguf is not None:
            tensors = mtp_tensors_from_gguf(gguf, target_cfg)
        else:
            tensors = load_safetensors(model_dir, only=("mtp.",))
        return cls(target_cfg, tensors, target, dtype, max_len, device)

    def inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input rows: fc(concat(norm(embedding), norm(hidden))), the embedding first."""
        e = self.target._embed(input_ids)
        both = torch.cat([rms_norm(e, self.enorm, self.eps), rms_norm(hidden.to(e.dtype), self.hnorm, self.eps)], -1)
        return linear(both, self.fc, use_kernel=self.use_kernel)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: Any,
                kv_caches: list[Any], logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over packed rows: row ``r`` holds token ``p + 1`` and the hidden state of
        position ``p`` (``positions[r] == p``). Returns the logits of the rows in ``logits_indices``
        (each predicting token ``p + 2``) and their normed hidden states, the next step's input."""
        out = self.model.forward(input_ids, positions, meta, kv_caches, logits_indices,
                                 embeds=self.inputs(input_ids, hidden))
        return out.logits, out.hidden


class MTPProposer:
    """The MTP head as the executor's drafter: its KV layer(s) over the target's blocks (as a draft
    model's), the target's hidden states handed over after each step, and each verify chunk's
    drafts written in before the target verifies them.

    The head's row at position ``p`` needs the target's hidden state at ``p`` and token ``p + 1``,
    so it runs one step behind the target: at a step's start it catches up over the positions the
    target computed before (``pending``) whose next token is known, then drafts. Its valid length
    (``lens``) only ever counts rows built from the target's own hidden states; a verify's drafted
    rows are computed again from the target's once it has verified them.
    """

    def __init__(self, head: MTPHead, num_speculative_tokens: int, block_size: int, kv_dtype: torch.dtype,
                 seed: int = 0) -> None:
        from ferry.executor.kv_tensors import kv_groups

        self.head, self.k, self.block_size, self.kv_dtype = head, num_speculative_tokens, block_size, kv_dtype
        self.groups = kv_groups(head.cfg)
        self.kv_caches: list[Any] = []
        self.lens: dict[str, int] = {}
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}  # (first position, target hidden rows)
        self.generator = torch.Generator(head.model.device).manual_seed(seed + 2)

    def bytes_per_block(self, block_size: int) -> int:
        """What one KV block costs the head (added to the target's when the cache is sized)."""
        from ferry.executor.kv_tensors import block_bytes

        return block_bytes(self.groups, block_size, self.kv_dtype)

    def allocate(self, num_blocks: int, zeros: Any) -> None:
        """The head's KV layers over the target's ``num_blocks`` blocks."""
        from ferry.executor.kv_tensors import allocate

        self.kv_caches = allocate(self.head.num_layers, self.groups, num_blocks * self.block_size, self.kv_dtype, zeros)

    # ------------------------------------------------------------------ after the target's step
    def observe(self, chunks: list[Any], all_hidden: torch.Tensor, sampled: dict[str, list[int]]) -> None:
        """Keep each chunk's target hidden rows whose inputs were true tokens (a verify's: its first
        token and the accepted drafts), in the packed order of ``chunks``."""
        from ferry.executor.batch import row_groups

        decodes, prefills = row_groups(chunks)
        row = 0
        for c in decodes + prefills:
            rows, row = all_hidden[row:row + c.num_tokens], row + c.num_tokens
            if c.padding:
                continue
            valid = c.num_tokens - len(c.spec_token_ids)
            if c.spec_token_ids and c.request_id in sampled:
                valid += len(sampled[c.request_id]) - 1
            self._keep(c.request_id, c.start, rows[:valid])

    def _keep(self, rid: str, start: int, rows: torch.Tensor) -> None:
        old = self.pending.get(rid)
        if old is not None and old[0] <= start <= old[0] + len(old[1]):
            rows = torch.cat([old[1][:start - old[0]], rows])
            start = old[0]
        self.pending[rid] = (start, rows.detach().clone())

    # ------------------------------------------------------------------ one step
    def forget(self, out: Any) -> None:
        """Drop the step's finished and preempted requests. Once per step: ``propose`` calls it."""
        for rid in list(out.finished_req_ids) + list(out.preempted_req_ids):
            self.lens.pop(rid, None)
            self.pending.pop(rid, None)

    def propose(self, out: Any, states: Any) -> dict[str, torch.Tensor]:
        """Catch the head up with every chunk's request, then write each verify chunk's drafts into
        ``chunk.spec_token_ids``; returns the drafts' distributions for requests that sample at a
        temperature (the verifier's ``q``)."""
        from ferry.core.outputs import ScheduledChunk
        from ferry.executor.draft import _DraftView

        self.forget(out)
        first: list[Any] = []
        views: dict[str, Any] = {}
        hidden: dict[str, torch.Tensor] = {}
        verifying: list[Any] = []
        for c in out.chunks:
            r = states[c.request_id]
            if c.padding or r.sampling_params.pooling is not None:
                continue
            known_end = c.start + c.num_tokens - len(c.spec_token_ids)
            pend = self.pending.get(c.request_id)
            if pend is None:
                continue
            p0, rows = pend
            start = max(min(self.lens.get(c.request_id, p0), c.start), p0)
            # Rows up to the one before the chunk's last known token (its next token is known).
            end = min(p0 + len(rows), len(r.all_token_ids) - 1, known_end - 1)
            drafts = bool(c.spec_token_ids) and end == known_end - 1
            if c.spec_token_ids and not drafts:
                continue  # nothing to draft from: the placeholders stay (the verify rejects them)
            if end <= start:
                continue
            view = _DraftView(c.request_id, r.all_token_ids[1:end + 1], r.block_ids)  # row p holds token p + 1
            views[c.request_id] = view
            hidden[c.request_id] = rows[start - p0:end - p0]
            self.pending[c.request_id] = (end, rows[end - p0:])  # rows before end are never read again
            first.append(ScheduledChunk(c.request_id, start, end - start, [], drafts))
            self.lens[c.request_id] = end
            if drafts:
                verifying.append(c)
        if not first:
            return {}
        sp_of = {c.request_id: states[c.request_id].sampling_params for c in verifying}
        proposals: dict[str, list[int]] = {c.request_id: [] for c in verifying}
        dists: dict[str, list[torch.Tensor]] = {}
        chunks, j = first, 0
        while chunks:
            rows_out = self._run(chunks, views, hidden)
            hidden = {}
            for rid, logits, h in rows_out:
                token = self._choose(logits, sp_of[rid], dists.setdefault(rid, []))
                proposals[rid].append(token)
                views[rid].all_token_ids.append(token)
                hidden[rid] = h[None]
            j += 1
            chunks = [ScheduledChunk(c.request_id, self.lens[c.request_id] + j - 1, 1, [], True)
                      for c in verifying if len(c.spec_token_ids) > j]
        for c in verifying:
            c.spec_token_ids[:] = proposals[c.request_id]
        return {rid: torch.stack(d) for rid, d in dists.items() if d}

    def _run(self, chunks: list[Any], views: dict[str, Any], hidden: dict[str, torch.Tensor]
             ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """One forward step of the head over ``chunks``: each sampling chunk's last row's logits and
        normed hidden state (the next step's input)."""
        from ferry.executor.batch import pack, row_groups

        batch = pack(chunks, views, self.block_size).to(self.head.model.device)  # type: ignore[arg-type]
        decodes, prefills = row_groups(chunks)
        h = torch.cat([hidden[c.request_id] for c in decodes + prefills])
        logits, out_h = self.head.forward(batch.input_ids, h, batch.positions, batch.meta, self.kv_caches,
                                          batch.logits_indices)
        return [(r.request_id, logits[i], out_h[i]) for i, (r, _) in enumerate(batch.sampling)]

    def _choose(self, logits: torch.Tensor, sp: Any, dists: list[torch.Tensor]) -> int:
        """The head's next token (``ferry.executor.sampler.draft_token``)."""
        from ferry.executor.sampler import draft_token

        return draft_token(logits, sp, dists, self.generator)
