"""Log-probabilities as the OpenAI API shapes them: completions' parallel lists, chat's per-token objects.

The runner hands out (token id, log-probability, [(id, log-probability)] of the
most likely alternatives) per token; this turns ids into the text pieces they
stand for. SentencePiece pieces carry their word marker as a space and byte
tokens (`<0xE2>`) their one byte, so the pieces of an answer join into its text
(a byte that is part of a longer character shows as U+FFFD, its `bytes` exact).
"""

from __future__ import annotations

import re

_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
Entry = tuple[int, float, list[tuple[int, float]]]


def piece(tokenizer, token_id: int) -> tuple[str, bytes]:
    """(text, UTF-8 bytes) one token stands for."""
    tok = tokenizer.convert_ids_to_tokens(int(token_id))
    if tok is None:
        return "", b""
    byte = _BYTE.fullmatch(tok)
    if byte:
        raw = bytes([int(byte.group(1), 16)])
        return raw.decode("utf-8", "replace"), raw
    text = tok.replace("\u2581", " ") if "\u2581" in tok else tokenizer.convert_tokens_to_string([tok])
    return text, text.encode()


def completion_logprobs(tokenizer, entries: list[Entry | None], ids: list[int], offset: int = 0) -> dict:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` for `ids` (an entry None: no log-probability,
    as for a prompt's first token)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(ids, entries):
        text, _ = piece(tokenizer, token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if entry is None else entry[1])
        out["top_logprobs"].append(None if entry is None else {piece(tokenizer, i)[0]: lp for i, lp in entry[2]})
    return out


def chat_logprobs(tokenizer, entries: list[Entry]) -> dict:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`."""
    def one(token_id: int, lp: float) -> dict:
        text, raw = piece(tokenizer, token_id)
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries]}
