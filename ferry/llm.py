"""The offline API: ``LLM(...).generate(prompts, params)`` and ``.chat(conversations)``."""
from __future__ import annotations

import time
from typing import Any, Sequence

from ferry.config import EngineConfig
from ferry.core.multimodal import ImageFeature
from ferry.core.sampling_params import SamplingParams
from ferry.engine.llm_engine import LLMEngine
from ferry.engine.outputs import RequestOutput
from ferry.model.tokenizer import apply_chat_template
from ferry.multimodal.images import ImageError, ImageLimits
from ferry.multimodal.parts import load_images, message_content, take_images

Prompt = str | list[int]


class LLM:
    """An engine on one model, for batch generation in-process.

    ``LLM()`` loads the embedded SmolLM2-135M-Instruct; ``LLM(model="DIR")`` a
    Hugging Face directory. Keyword arguments are engine settings (see EngineConfig).
    """

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        t0 = time.perf_counter()
        self.engine = LLMEngine.from_config(EngineConfig.from_kwargs(model=model, **settings))
        self.config = self.engine.config  # resolved: max_model_len is known
        self.startup_seconds = time.perf_counter() - t0
        self._counter = 0

    def close(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel ranks); also
        done at exit."""
        self.engine.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 images: Sequence[tuple[ImageFeature, ...]] | None = None) -> list[RequestOutput]:
        """Generate for every prompt together; outputs come back in input order.

        A prompt is a string or a list of token ids. With ``n > 1`` an output holds n completions.
        ``images``: each prompt's images, as ``chat`` makes them (``image_prompter.encode``).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(images)} image lists")
        # Every request is checked before any is queued, so a bad one leaves the engine untouched.
        ids: list[list[str]] = []
        added: list[str] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                subs = []
                for k in range(sp.n):
                    sub_sp = sp if sp.n == 1 else sp.nth(k)
                    rid = f"{self._counter}-{i}-{k}"
                    self.engine.add_request(prompt, sub_sp, request_id=rid,
                                            priority=priority[i] if priority else 0,
                                            images=images[i] if images else ())
                    added.append(rid)
                    subs.append(rid)
                ids.append(subs)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        finally:
            self._counter += 1
        final = self._run(len(added), use_tqdm)
        outputs = []
        for subs in ids:
            first = final[subs[0]]
            for k, rid in enumerate(subs[1:], start=1):
                comp = final[rid].outputs[0]
                comp.index = k
                first.outputs.append(comp)
            outputs.append(first)
        return outputs

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, image_limits: ImageLimits | None = None) -> list[RequestOutput]:
        """Like generate, with each conversation rendered by the model's chat template.

        A message's content may be a list of parts, as OpenAI's chat takes them: text, and images
        as ``{"type": "image_url", "image_url": {"url": ...}}`` or ``{"type": "image", "image":
        PATH | bytes | PIL.Image}``, for a model that takes images. ``image_limits``: what an
        image may be (default: ``ImageLimits()``; URLs are fetched only where it allows them).
        Raises ImageError (a ValueError naming the part) for an image that cannot be used."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts, images = [], []
        for conv in conversations:
            ids, features = self._chat_prompt(conv, image_limits or ImageLimits())  # type: ignore[arg-type]
            prompts.append(ids)
            images.append(features)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, images=images)

    def _chat_prompt(self, conv: list[dict[str, Any]], limits: ImageLimits
                     ) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """A conversation's prompt token ids and its images' features."""
        conv = [{**m, "content": message_content(m["content"], f"messages[{i}].content", m.get("role"),
                                                 own_images=True)}
                if isinstance(m.get("content"), list) else m for i, m in enumerate(conv)]
        conv, refs = take_images(conv)
        if not refs:
            return apply_chat_template(self.tokenizer, conv), ()
        prompter = self.engine.image_prompter
        if prompter is None:
            raise ImageError(f"{refs[0].field}: this model does not accept images", refs[0].field)
        pictures = load_images(refs, limits)
        return prompter.encode(self.tokenizer.render_chat(conv), pictures)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = "last",
              use_tqdm: bool = True) -> list[list[float]]:
        """Each prompt's embedding: its final hidden states pooled (the last token's, or "mean")
        and L2-normalised, computed through the same scheduler as generation."""
        # max_tokens 1: an embedding generates nothing, so it reserves no room past its prompt.
        outs = self.generate(prompts, SamplingParams(pooling=pooling, max_tokens=1), use_tqdm=use_tqdm)
        return [o.embedding for o in outs]

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
        n_out, t0 = 0, time.perf_counter()
        while self.engine.has_unfinished():
            for out in self.engine.step():
                n_out += 1
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.set_postfix_str(f"out {n_out / max(time.perf_counter() - t0, 1e-9):.1f} tok/s", refresh=False)
        if bar is not None:
            bar.close()
        return final

