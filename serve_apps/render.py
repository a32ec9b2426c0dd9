"""Replica events to OpenAI responses: whole bodies and streamed chunks, for completions and chat.

A request fans out into choices (each prompt times `n`); each choice is one
replica stream of events: `start` (token counts, prompt log-probabilities when
asked), `delta`s (text, and the log-probabilities of the tokens behind it),
`end` (finish reason, the last log-probabilities). `gather` collects one stream
whole; `merge` interleaves the choices' streams as their replicas produce them;
a renderer turns one choice's events into its part of the response.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from .errors import APIError
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import chat_body, chat_choice, chat_chunk, completion_body, completion_choice, usage


@dataclass
class Choice:
    """One choice of a request: its index in the response, its prompt, and what came back so far."""

    index: int
    prompt_ids: list[int]
    prompt_text: str = ""
    text: str = ""
    entries: list = field(default_factory=list)  # output log-probabilities
    offset: int = 0  # characters of echoed prompt + text handed out (completions' text_offset)


@dataclass
class Answer:
    """One choice's whole stream, gathered."""

    start: dict
    text: str
    end: dict
    entries: list


class CompletionRender:
    def __init__(self, tokenizer, rid: str, model: str, echo: bool, logprobs: int | None) -> None:
        self.tok, self.rid, self.model, self.echo, self.logprobs = tokenizer, rid, model, echo, logprobs

    def _lp(self, choice: Choice, entries: list, ids: list[int]) -> dict | None:
        if self.logprobs is None:
            return None
        out = completion_logprobs(self.tok, entries, ids, choice.offset)
        choice.offset += sum(len(t) for t in out["tokens"])
        return out

    def _prompt_lp(self, choice: Choice, start: dict) -> dict | None:
        entries = [None] + list(start.get("prompt_logprobs") or [])  # the first token has no log-probability
        return self._lp(choice, entries[: len(choice.prompt_ids)], choice.prompt_ids)

    def whole(self, choice: Choice, answer: Answer) -> dict:
        head = self._prompt_lp(choice, answer.start) if self.echo else None
        tail = self._lp(choice, answer.entries, [e[0] for e in answer.entries])
        lp = None if tail is None else ({k: head[k] + tail[k] for k in tail} if head else tail)
        text = (choice.prompt_text if self.echo else "") + answer.text
        return completion_choice(choice.index, text, answer.end["finish_reason"], lp)

    def body(self, choices: list[dict], use: dict) -> dict:
        return completion_body(self.rid, self.model, choices, use)

    def opening(self, choice: Choice, start: dict) -> list[dict]:
        if not self.echo:
            return []
        return [self.chunk([completion_choice(choice.index, choice.prompt_text, None, self._prompt_lp(choice, start))])]

    def delta(self, choice: Choice, event: dict) -> dict:
        lp = self._lp(choice, event.get("logprobs") or [], [e[0] for e in event.get("logprobs") or []])
        return self.chunk([completion_choice(choice.index, event["text"], None, lp)])

    def end(self, choice: Choice, event: dict) -> list[dict]:
        rest = event.get("logprobs") or []
        lp = self._lp(choice, rest, [e[0] for e in rest]) if rest else None
        return [self.chunk([completion_choice(choice.index, "", event["finish_reason"], lp)])]

    def chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        return completion_body(self.rid, self.model, choices, use, chunk=True)

    def usage_chunk(self, use: dict) -> dict:
        return self.chunk([], use)


class ChatRender:
    def __init__(self, tokenizer, rid: str, model: str, logprobs: bool) -> None:
        self.tok, self.rid, self.model, self.logprobs = tokenizer, rid, model, logprobs

    def _lp(self, entries: list) -> dict | None:
        return chat_logprobs(self.tok, entries) if self.logprobs else None

    def whole(self, choice: Choice, answer: Answer) -> dict:
        return chat_choice(choice.index, answer.text, answer.end["finish_reason"], self._lp(answer.entries))

    def body(self, choices: list[dict], use: dict) -> dict:
        return chat_body(self.rid, self.model, choices, use)

    def opening(self, choice: Choice, start: dict) -> list[dict]:
        return [chat_chunk(self.rid, self.model, choice.index, {"role": "assistant", "content": ""}, None)]

    def delta(self, choice: Choice, event: dict) -> dict:
        return chat_chunk(self.rid, self.model, choice.index, {"content": event["text"]}, None,
                          self._lp(event.get("logprobs") or []))

    def end(self, choice: Choice, event: dict) -> list[dict]:
        rest = event.get("logprobs") or []
        return [chat_chunk(self.rid, self.model, choice.index, {}, event["finish_reason"],
                           self._lp(rest) if rest else None)]

    def usage_chunk(self, use: dict) -> dict:
        return chat_chunk(self.rid, self.model, 0, {}, None, use=use, choices=False)


async def gather(first: dict, events) -> Answer:
    """One replica stream, whole."""
    start, parts, end, entries, event = None, [], None, [], first
    while True:
        if event["type"] == "error":
            raise APIError(400, event["message"], code="context_length_exceeded")
        if event["type"] == "start":
            start = event
        elif event["type"] == "delta":
            parts.append(event["text"])
            entries += event.get("logprobs") or []
        elif event["type"] == "end":
            end = event
            entries += event.get("logprobs") or []
        try:
            event = await events.__anext__()
        except StopAsyncIteration:
            return Answer(start, "".join(parts), end, entries)


def total_usage(starts: dict[int, dict], ends: dict[int, dict], n: int) -> dict:
    """Usage summed over choices; a prompt's tokens count once, not once per each of its n choices."""
    firsts = [s for i, s in starts.items() if i % n == 0]
    return usage(sum(s["prompt_tokens"] for s in firsts), sum(e["completion_tokens"] for e in ends.values()),
                 sum(s["cached_tokens"] for s in firsts), sum(s.get("segment_tokens", 0) for s in firsts))


async def merge(streams: list, render, n: int, include_usage: bool) -> AsyncIterator[dict]:
    """Chunks of every choice's stream `(choice, events, first event)`, in the order the replicas produce them;
    a stream's failure is raised here (the caller reports it in-band)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice, events, first: dict) -> None:
        try:
            await queue.put((choice, first))
            async for event in events:
                await queue.put((choice, event))
        except Exception as exc:  # noqa: BLE001 - handed to the merged stream
            await queue.put((choice, exc))
        finally:
            await queue.put((choice, None))

    tasks = [asyncio.create_task(pump(*stream)) for stream in streams]
    starts, ends, running = {}, {}, len(tasks)
    try:
        while running:
            choice, event = await queue.get()
            if event is None:
                running -= 1
            elif isinstance(event, Exception):
                raise event
            elif event["type"] == "start":
                starts[choice.index] = event
                for chunk in render.opening(choice, event):
                    yield chunk
            elif event["type"] == "delta":
                yield render.delta(choice, event)
            elif event["type"] == "end":
                ends[choice.index] = event
                for chunk in render.end(choice, event):
                    yield chunk
        if include_usage:
            yield render.usage_chunk(total_usage(starts, ends, n))
    finally:
        for task in tasks:
            task.cancel()


def prompt_text(tokenizer, prompt: str | list[int]) -> str:
    """The text an echoed prompt shows: the string sent, or its token ids decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=True)
