"""Prompt text to token ids off the event loop, after bounds that cost nothing.

Tokenizing and rendering chat templates are CPU work proportional to the text;
done in the ingress's async handler they stall every other client for as long
as the largest prompt takes. Here they run in a small thread pool (the HF fast
tokenizer releases the GIL while it encodes), so a slow request delays only
itself, and the work a request can cause is bounded before any of it starts:

- a text longer than `window x longest token` characters cannot fit the window
  whatever it holds; only its first `window x longest token` characters are
  tokenized, which already gives more tokens than the window has, and the
  request is refused naming the field. (Checking the prefix instead of trusting
  the character count alone keeps the check sound for tokenizers whose
  normalizer drops characters.)
- a shorter text is tokenized whole, in the pool.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kvcluster.serving.chat import ChatMessage, render_chat


class PromptTooLong(ValueError):
    """The text cannot fit the context window; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def longest_token_chars(tokenizer) -> int:
    """The most characters any single vocabulary entry stands for (SentencePiece's word marker counts as one)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


class PromptEncoder:
    def __init__(self, tokenizer, window: int, threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.window = window
        self.token_chars = longest_token_chars(tokenizer)
        self.max_chars = window * self.token_chars  # more characters than this: look at a prefix only
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvcluster-tokenize")

    async def run(self, fn, *args):
        """`fn(*args)` in the tokenizer pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; PromptTooLong when it cannot fit the window (found without tokenizing it all)."""
        await self.check_fits(text, param)
        return await self.run(lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def render(self, messages: Sequence[ChatMessage]):
        """Chat prompt ids and spans (kvcluster.serving.chat.render_chat), bounded the same way."""
        if len(messages) > self.window:
            raise PromptTooLong(f"{len(messages)} messages cannot fit a context window of {self.window} tokens",
                                "messages")
        await self.check_fits("\n".join(m.text() for m in messages), "messages")
        return await self.run(render_chat, self.tokenizer, messages)

    async def check_fits(self, text: str, param: str) -> None:
        if len(text) <= self.max_chars:
            return
        head = text[: self.max_chars + self.token_chars]
        tokens = await self.run(lambda: len(self.tokenizer.encode(head, add_special_tokens=False)))
        if tokens > self.window:  # else a normalizer dropped characters: the whole text is tokenized below
            raise PromptTooLong(f"{param} has {len(text)} characters; its first {len(head)} alone are {tokens} "
                                f"tokens, more than this model's context window of {self.window}", param)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
