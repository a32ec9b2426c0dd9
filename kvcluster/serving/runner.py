"""The model runner: prefill only what the cache lacks, decode token by token, write new blocks back.

Per request: split the prompt into block keys (chained over token ids, the model
fingerprint and the tenant's salt), fetch the longest cached prefix in one call,
rebuild the transformers cache from it, prefill the remaining tokens, then decode.
At least the prompt's last token is always computed (its logits pick the first
new token). When the request ends, every full block it computed (prompt and
answer) goes back to the store in one call, so the next turn of a conversation
finds its whole history; after a position-independent segment hit, only the
blocks before that segment do (see `finish`).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from ..block_types import BlockType, TransitionType, pair_index
from ..errors import KvclusterError
from ..keys import BlockKey, KeySpace
from ..storage.layout import layout_for
from ..traces.classify import majority_block_types
from .block_store import BlockStore
from .kv_codec import KVCodec
from .models import LoadedModel
from .rope import RopeGeometry, rope_geometry
from .sampling import SamplingParams, make_generator, next_token, token_logprobs

log = logging.getLogger(__name__)


class RequestTooLong(KvclusterError):
    """Prompt plus max_tokens does not fit the model's context window."""


@dataclass
class Generation:
    """One request in flight."""

    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str
    spans: list[tuple[int, int]] = field(default_factory=list)  # (block type, tokens) of the prompt
    segments: list[tuple[int, int]] = field(default_factory=list)  # [start, end) reusable at any position
    cached_tokens: int = 0  # the exact prefix served from the cache
    segment_tokens: int = 0  # segment tokens served from the cache at another position (re-rotated)
    rerotated_from: int | None = None  # start of the first re-rotated segment: KV from here on is approximate
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded output so far, stop strings cut off
    emitted: int = 0  # characters of `text` already handed out
    finish_reason: str | None = None
    hit_eos: bool = False  # the last output id is the end-of-sequence token (not part of the text)
    ttft_s: float = 0.0
    fetch_s: float = 0.0  # lookup + load + cache build, excluding model compute
    session: str = ""  # whose requests these are (the API's `user`): the eviction policy learns its pace
    cache: object = None
    generator: torch.Generator | None = None
    stored_blocks: int = 0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)  # per output token
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)  # tokens 1..

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids) - int(self.hit_eos)


def _segment_rope(model) -> RopeGeometry | None:
    """The RoPE geometry segments are re-rotated with; None where they cannot be (then only prefixes are reused)."""
    try:
        return rope_geometry(model)
    except NotImplementedError as exc:  # e.g. gemma-3: a different RoPE per layer type
        log.info("segment reuse off for this model: %s", exc)
        return None


class ModelRunner:
    def __init__(self, loaded: LoadedModel, store: BlockStore | None = None, block_tokens: int = 16,
                 root_seed: str = "kvcluster-v1") -> None:
        self.loaded = loaded
        self.store = store
        self.block_tokens = block_tokens
        self.layout = layout_for(loaded.spec, block_tokens, loaded.dtype)
        self.device = next(loaded.model.parameters()).device
        self.codec = KVCodec(self.layout, loaded.model.config, device=self.device)
        # transformers >= 5.20 names the cache argument `cache`; earlier 5.x (e.g. a GPU image's 5.17) `past_key_values`
        params = inspect.signature(loaded.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # Prefill needs the last position's logits only: the LM head over every prompt token is up to
        # 40% of a small model's prefill (its vocabulary row count dwarfs the hidden size).
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.rope = _segment_rope(loaded.model)  # None: segments cannot move (absolute or per-layer RoPE)
        self.keys = KeySpace(model=loaded.fingerprint, root_seed=root_seed)
        self._stop_holdback = 0

    # ---- keys -------------------------------------------------------------------------------------------

    def block_keys(self, token_ids: Sequence[int], cache_salt: str = "") -> list[BlockKey]:
        return self.keys.chain_token_ids(token_ids, self.block_tokens, cache_salt)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        window = self.loaded.context_window
        if prompt_tokens == 0:
            raise RequestTooLong("the prompt is empty")
        if prompt_tokens + max_tokens > window:
            raise RequestTooLong(f"this model's context window is {window} tokens; the prompt has {prompt_tokens} "
                                 f"and max_tokens asks for {max_tokens} more")

    # ---- one request ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, prompt_ids: Sequence[int], params: SamplingParams, cache_salt: str = "",
              spans: Sequence[tuple[int, int]] = (), segments: Sequence[tuple[int, int]] = (),
              session: str = "") -> Generation:
        """Fetch the cached prefix, prefill the rest and pick the first token.

        `segments` are token ranges whose KV may come from anywhere it was cached before
        (a document or tool result that appeared at another offset): their blocks are
        keyed by content alone, stored rotated to position 0 and re-rotated to where they
        sit now. Opt-in: only layer 0 is then exactly what prefill would compute, since
        deeper layers saw a different context; prefix reuse stays exact, because `finish`
        never stores that KV, or any computed after it, under prefix keys.
        """
        self.check_fits(len(prompt_ids), params.max_tokens)
        t0 = time.perf_counter()
        whole = params.prompt_logprobs is not None  # every prompt position's logits: nothing from the cache
        gen = Generation(list(prompt_ids), params, cache_salt, list(spans) or [(BlockType.HISTORY, len(prompt_ids))],
                         [] if whole else self._usable_segments(segments, len(prompt_ids)),
                         generator=make_generator(params, self.device), session=session)
        payloads = [] if whole else self._fetch_prefix(gen.prompt_ids, cache_salt)
        gen.cache = self.codec.decode(payloads, reuse_buffer=True)  # the prefill below copies out of it
        gen.cached_tokens = len(payloads) * self.block_tokens
        gen.fetch_s = time.perf_counter() - t0
        pos = gen.cached_tokens
        for s, e in gen.segments:
            if s < pos:
                continue
            found = self._fetch_segment(gen, s, e)
            if not found:
                continue
            if s > pos:
                self._forward(gen.prompt_ids[pos:s], gen.cache, all_logits=False)
            if gen.rerotated_from is None:
                gen.rerotated_from = s
            self.codec.append(gen.cache, self.codec.rerotate(found, s, self.rope))
            pos = s + len(found) * self.block_tokens
            gen.segment_tokens += pos - s
        out = self._forward(gen.prompt_ids[pos:], gen.cache, all_logits=whole)
        if whole:
            gen.prompt_logprobs = [(t, *token_logprobs(out.logits[0, i], t, params.prompt_logprobs))
                                   for i, t in enumerate(gen.prompt_ids[1:])]
        self._pick(gen, out.logits[0, -1])
        gen.ttft_s = time.perf_counter() - t0
        return gen

    @torch.inference_mode()
    def step(self, gen: Generation) -> None:
        """Decode one more token."""
        if gen.done:
            return
        out = self._forward([gen.output_ids[-1]], gen.cache, all_logits=False)
        self._pick(gen, out.logits[0, -1])

    def new_text(self, gen: Generation) -> str:
        """Output text not handed out yet (a possible stop-string start is held back until decided)."""
        hold = 0 if gen.done else max((len(s) - 1 for s in gen.params.stop), default=0)
        end = max(gen.emitted, len(gen.text) - hold)
        if not gen.done and gen.text[gen.emitted:end].endswith("\ufffd"):  # half a multi-byte character
            end = gen.emitted
        delta, gen.emitted = gen.text[gen.emitted:end], end
        return delta

    def finish(self, gen: Generation) -> None:
        """Store every full block this request computed exactly (one call), then drop its cache.

        Prefix keys promise the KV a cold prefill of those tokens computes, so a hit is
        exact. After a segment was served re-rotated, that no longer holds from the
        segment's first token on: its deeper layers were computed in another context, and
        every later token (prompt and answer) attended to it. So only the blocks wholly
        before `rerotated_from` go under prefix keys (a later plain request computes and
        stores the rest exactly); the segments still go under their content keys, whose
        reuse is approximate by opt-in.
        """
        if self.store is not None and gen.cache is not None:
            seq = gen.prompt_ids + gen.output_ids[:-1]  # the last token was never fed back
            keys = self.block_keys(seq, gen.cache_salt)
            if gen.rerotated_from is not None:
                keys = keys[: gen.rerotated_from // self.block_tokens]
            first_new = gen.cached_tokens // self.block_tokens
            new = self.codec.encode(gen.cache, first_new, len(keys))
            if keys:  # even with nothing new: the store tells the reuse predictor these blocks were used
                self.store.store(keys, [None] * first_new + new, self.pairs(gen, len(keys)),
                                 finish=gen.finish_reason or "", output_tokens=len(gen.output_ids),
                                 session=gen.session)
                gen.stored_blocks = len(new)
            for s, e in gen.segments:  # content-keyed copies, rotated back to position 0
                blocks = (min(e, len(seq)) - s) // self.block_tokens
                if blocks > 0:
                    canonical = self.codec.rerotate(self.codec.encode(gen.cache, 0, blocks, start_token=s), -s, self.rope)
                    self.store.store(self._segment_keys(gen, s, blocks), canonical)
        gen.cache = None

    def pairs(self, gen: Generation, blocks: int) -> list[int]:
        """The reuse predictor's (block type, transition) pair of each of the request's blocks."""
        spans = gen.spans + [(BlockType.OUTPUT, len(gen.output_ids))]
        types = majority_block_types([(BlockType(t), n) for t, n in spans], self.block_tokens)[:blocks]
        transition = TransitionType.APPEND if gen.cached_tokens else TransitionType.FIRST
        return [pair_index(t, transition) for t in types]

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, cache_salt: str = "",
                 segments: Sequence[tuple[int, int]] = (), session: str = "") -> Iterator[str]:
        """Text deltas of a whole request (the streaming form of start/step/finish)."""
        gen = self.start(prompt_ids, params, cache_salt, segments=segments, session=session)
        try:
            while True:
                delta = self.new_text(gen)
                if delta:
                    yield delta
                if gen.done:
                    break
                self.step(gen)
        finally:
            self.finish(gen)

    def complete(self, prompt_ids: Sequence[int], params: SamplingParams, cache_salt: str = "",
                 segments: Sequence[tuple[int, int]] = (), session: str = "") -> Generation:
        """Run a request to the end (non-streaming)."""
        gen = self.start(prompt_ids, params, cache_salt, segments=segments, session=session)
        try:
            while not gen.done:
                self.step(gen)
            self.new_text(gen)
        finally:
            self.finish(gen)
        return gen

    # ---- internals -------------------------------------------------------------------------------------

    def _forward(self, token_ids: Sequence[int], cache, all_logits: bool):
        """Extend `cache` by `token_ids`; logits for every position only when `all_logits`, else the last one's."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        keep = {} if all_logits else self._last_logits
        return self.loaded.model(input_ids=ids, use_cache=True, **{self._cache_arg: cache}, **keep)

    def _usable_segments(self, segments: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
        """Segments holding at least one full block, inside the prompt, not overlapping; none without RoPE."""
        if self.rope is None or self.store is None:
            return []
        out, last = [], 0
        for s, e in sorted((int(s), min(int(e), n - 1)) for s, e in segments):  # the last token is always computed
            if s >= last and e - s >= self.block_tokens:
                out.append((s, e))
                last = e
        return out

    def _segment_keys(self, gen: Generation, start: int, blocks: int) -> list[BlockKey]:
        tokens = gen.prompt_ids[start : start + blocks * self.block_tokens]
        return self.keys.chain_token_ids(tokens, self.block_tokens, f"{gen.cache_salt}\x1fsegment")

    def _fetch_segment(self, gen: Generation, start: int, end: int) -> list[np.ndarray]:
        keys = self._segment_keys(gen, start, (end - start) // self.block_tokens)
        found = []
        for p in self.store.fetch(keys):
            if not self.codec.check(p):
                break
            found.append(p)
        return found

    def _fetch_prefix(self, prompt_ids: list[int], cache_salt: str) -> list[np.ndarray]:
        if self.store is None:
            return []
        usable = (len(prompt_ids) - 1) // self.block_tokens  # the last prompt token is always computed
        keys = self.block_keys(prompt_ids[: usable * self.block_tokens], cache_salt)
        if not keys:
            return []
        landing = self.codec.landing(len(keys), on_device=getattr(self.store, "device_buffers", False))
        payloads = self.store.fetch(keys, landing)  # decoded (copied) before the next fetch
        good = []
        for p in payloads[:usable]:
            if not self.codec.check(p):  # wrong size: a miss from here on, never wrong KV
                break
            good.append(p)
        return good

    def _pick(self, gen: Generation, logits: torch.Tensor) -> None:
        """Sample the next token (end-of-sequence masked until min_tokens), note its log-probabilities, accept it."""
        p = gen.params
        sampled = logits
        if len(gen.output_ids) < p.min_tokens and not p.ignore_eos and self.loaded.eos_token_ids:
            sampled = logits.clone()
            sampled[list(self.loaded.eos_token_ids)] = float("-inf")
        token = next_token(sampled, p, gen.generator)
        if p.logprobs is not None:
            gen.logprobs.append((token, *token_logprobs(logits, token, p.logprobs)))
        self._accept(gen, token)

    def _accept(self, gen: Generation, token: int) -> None:
        gen.output_ids.append(token)
        p, tok = gen.params, self.loaded.tokenizer
        if token in self.loaded.eos_token_ids and not p.ignore_eos:
            gen.hit_eos, gen.finish_reason = True, "stop"  # eos ends the answer and is not part of its text
            return
        before = len(gen.text)
        gen.text = tok.decode(gen.output_ids, skip_special_tokens=True)
        for stop in p.stop if len(gen.output_ids) > p.min_tokens else ():
            at = gen.text.find(stop, max(0, before - len(stop) + 1))  # only where the new text could complete it
            if at >= 0:
                gen.text = gen.text[:at]
                gen.finish_reason = "stop"
                return
        if len(gen.output_ids) >= p.max_tokens:
            gen.finish_reason = "length"
        elif len(gen.prompt_ids) + len(gen.output_ids) >= self.loaded.context_window:
            gen.finish_reason = "length"
