"""One thread drives an in-process vLLM engine; async callers get each request's outputs through a queue.

vLLM's `LLMEngine` is synchronous and not thread-safe, and the replica runs it with its worker in the same
process (the "uni" executor), where `KVClusterConnector`'s scheduler asks the worker's store itself rather
than following its reports a step late. So the replica keeps the engine in its own process and lets exactly
one thread touch it: that thread adds the requests callers submitted, aborts the ones they gave up on, and steps
the engine while any request runs, so concurrent requests batch together as in vLLM's own server. Each step's
outputs go to the submitting caller's asyncio queue on the caller's event loop; an engine step that raises
fails every request in flight with that error and marks the loop dead (the replica's health check then
fails and Serve replaces it).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class EngineDead(RuntimeError):
    """The engine raised during a step; nothing more runs on it."""


class EngineLoop:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []  # ("add", id, prompt, params, loop, queue) | ("abort", id)
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvcluster-vllm-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt: dict, params: Any) -> asyncio.Queue:
        """Queue a request (call on the event loop); its RequestOutputs, or one exception, arrive on the queue
        returned, the last output with `finished` set."""
        if self.error is not None:
            raise EngineDead(f"the vLLM engine failed: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._post(("add", request_id, prompt, params, asyncio.get_running_loop(), queue))
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request the caller no longer reads (a client gone); a finished one is left alone."""
        self._post(("abort", request_id))

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def _post(self, item: tuple) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                work, self._inbox = self._inbox, []
            for item in work:
                self._apply(item)
            if not self._waiting:
                continue
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # noqa: BLE001 - handed to every caller, then the loop stops
                self.error = exc
                for request_id in list(self._waiting):
                    self._deliver(request_id, EngineDead(f"the vLLM engine failed: {exc!r}"), last=True)
                return
            for out in outputs:
                self._deliver(out.request_id, out, last=out.finished)

    def _apply(self, item: tuple) -> None:
        if item[0] == "abort":
            if self._waiting.pop(item[1], None) is not None:
                self.engine.abort_request([item[1]])
            return
        _, request_id, prompt, params, loop, queue = item
        self._waiting[request_id] = (loop, queue)
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal (a bad parameter, a prompt too long) for the caller
            self._deliver(request_id, exc, last=True)

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        target = self._waiting.pop(request_id, None) if last else self._waiting.get(request_id)
        if target is not None:
            loop, queue = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody reads this request any more
                pass
