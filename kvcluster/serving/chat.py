"""Chat messages to prompt token ids, prefix-stable across turns.

Each message is tokenized on its own and the pieces are concatenated, so the
tokens of turn k are exactly the leading tokens of turn k+1 and a conversation's
history is a cache hit. The format is Mistral's `[INST] ... [/INST]` (the
built-in tokenizer is Mistral-7B's); a checkpoint that ships its own chat
template uses that instead. Spans record which role owns which tokens: the
reuse predictor's block types come from them.
"""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..block_types import BlockType
from ..traces.classify import role_type


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(pattern="^(system|developer|user|assistant|tool)$")
    content: str | list[dict] | None = None
    name: str | None = Field(None, max_length=256, description="Accepted and ignored.")
    kv_reuse: Literal["prefix", "anywhere"] = Field(
        "prefix", description="anywhere: this message's KV may be reused at another position (a document or tool "
                              "result), re-rotated; approximate beyond layer 0, so opt-in.")

    def text(self) -> str:
        """Plain text content (OpenAI content parts of type text are joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


def reusable_segments(messages: Sequence[ChatMessage], spans: Sequence[tuple[BlockType, int]]) -> list[tuple[int, int]]:
    """Token ranges [start, end) of the messages marked `kv_reuse: anywhere` (spans[0] is the BOS token)."""
    out, at = [], spans[0][1] if spans else 0
    if len(spans) != len(messages) + 1:  # a checkpoint's own template: no per-message spans
        return []
    for m, (_, n) in zip(messages, spans[1:]):
        if m.kv_reuse == "anywhere":
            out.append((at, at + n))
        at += n
    return out


def render_chat(tokenizer, messages: Sequence[ChatMessage]) -> tuple[list[int], list[tuple[BlockType, int]]]:
    """Prompt ids ending with the assistant's turn opening, and (block type, tokens) spans."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                            tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return ids, [(BlockType.HISTORY, len(ids))]
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    ids, spans = [tokenizer.bos_token_id], [(BlockType.SYSTEM, 1)]
    for m in messages:
        if m.role in ("system", "developer"):
            piece = encode(m.text() + "\n\n")
        elif m.role == "assistant":
            piece = encode(" " + m.text()) + [tokenizer.eos_token_id]
        else:  # user and tool results open an instruction
            piece = encode(f"[INST] {m.text()} [/INST]")
        ids += piece
        spans.append((role_type(m.role), len(piece)))
    return ids, spans
