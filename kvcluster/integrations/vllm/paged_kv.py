"""`PagedKV`: whole blocks moved between an engine's paged KV tensors and host rows, batched, on any device.

An engine keeps one paged tensor per attention layer, `[num_blocks, ...]`, block b of a layer being one
contiguous page of `page_bytes` bytes. kvcluster stores a block as one row of `layers x page_bytes` bytes:
layer 0's page of the block, then layer 1's, and so on (the connector's payload format; stored blocks
depend on it). This module imports no vLLM, so it is tested without the engine and measured on a GPU alone.

Why batched: on a CUDA device a block of a 32-layer model is 32 small pages in 32 tensors; a PCIe copy per
page costs a launch and a synchronisation each. So on CUDA every layer's pages of the batch are gathered on
the device into one staging tensor `[n, layers, page]` (an `index_select` per layer) and cross the bus in
ONE copy, into a reusable pinned host buffer. Loads go the other way: the payloads are collected in pinned
landing rows (`landing`: a caller that reads its tier straight into them saves that host copy), cross in
ONE host->device copy, and an `index_copy_` per layer puts each layer's pages in place.

On the CPU there is no bus and no staging: a save selects each layer's pages straight into the rows (one
`index_select` per layer, not one copy call per page: small pages cost the call, not the bytes); a load
copies each layer's page straight into its block (CPU `index_copy_` from strided rows is slower than plain
page copies). The branch is chosen by the tensors' `device.type`.

Memory: the host buffers and the device staging tensor grow to the largest batch seen and are reused.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

from ...errors import ConfigError
from ...storage.aligned import aligned_host_tensor

Payload = Union[np.ndarray, torch.Tensor]


class PagedKV:
    """Per-layer paged KV tensors (all on one device) seen as `[num_blocks, page_bytes]` byte pages.

    `gather` and `scatter` are not thread-safe (they share buffers): call them from one thread, as an
    engine's worker does.
    """

    def __init__(self, layers: Sequence[torch.Tensor], names: Sequence[str], num_blocks: int, page_bytes: int):
        if len(layers) != len(names) or not layers:
            raise ConfigError(f"paged KV: {len(layers)} tensors for {len(names)} layer names (need one each, >= 1)")
        self.device = layers[0].device
        self.num_blocks, self.page_bytes = num_blocks, page_bytes
        self._pages = [_byte_pages(t, name, num_blocks, page_bytes, self.device) for t, name in zip(layers, names)]
        self._out: torch.Tensor | None = None  # gather's host rows
        self._in: torch.Tensor | None = None  # scatter's host rows
        self._stage: torch.Tensor | None = None  # CUDA: [rows, layers, page] on the device

    @property
    def row_bytes(self) -> int:
        """Bytes of one block, all layers: the length of a stored payload."""
        return self.page_bytes * len(self._pages)

    @property
    def layers(self) -> int:
        return len(self._pages)

    @property
    def regions(self) -> list[torch.Tensor]:
        """Every layer's tensor as `[num_blocks, page_bytes]` bytes: the memory a transfer engine registers to
        write blocks straight into their pages (`block_pages`)."""
        return list(self._pages)

    def block_pages(self, block_id: int) -> list[torch.Tensor]:
        """Block `block_id`'s pages, layer 0 first: where a stored row's bytes go, in order (`scatter` writes
        the same bytes from a row)."""
        (b,) = self._checked([block_id])
        return [pages[b] for pages in self._pages]

    def gather(self, block_ids: Sequence[int], into: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks `block_ids` as host rows `[n, row_bytes]` uint8: row j is layer 0's page of block_ids[j],
        then layer 1's, ...

        The rows live in a buffer this object reuses: they are valid until the next `gather`, so store
        (copy) them before gathering again, or pass rows of your own as `into` (`new_rows`). Pinned when
        the paged tensors are on CUDA.
        """
        ids = self._checked(block_ids)
        n, cuda = len(ids), self.device.type == "cuda"
        if into is not None and (tuple(into.shape) != (n, self.row_bytes) or into.dtype != torch.uint8
                                 or into.device.type != "cpu" or not into.is_contiguous()):
            raise ValueError(f"paged KV: gather into a contiguous host uint8 tensor of shape {(n, self.row_bytes)}, "
                             f"not {into.dtype} {tuple(into.shape)} on {into.device}")
        out = self._rows("_out", n) if into is None else into
        if not ids:
            return out
        stage = self._staging(n) if cuda else out.view(n, self.layers, self.page_bytes)  # CPU: the rows
        index = torch.tensor(ids, dtype=torch.long).to(self.device)
        for i, pages in enumerate(self._pages):
            torch.index_select(pages, 0, index, out=stage[:, i])
        if cuda:  # one bus crossing for the batch
            out.copy_(stage.view(n, self.row_bytes), non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # the caller reads the rows next
        return out

    def new_rows(self, n: int) -> torch.Tensor:
        """`n` host rows of a block each, the caller's to keep (pinned for CUDA, page-aligned): what an
        asynchronous load reads into, or a save stores from, while the next step gathers and scatters."""
        return aligned_host_tensor(n, self.row_bytes, pin=self.device.type == "cuda")

    def landing(self, n: int) -> torch.Tensor:
        """`n` host rows (pinned for CUDA) to read payloads into before `scatter`: payload j found in landing
        row j is not copied again on the host. Reused by the next `landing` or `scatter`."""
        return self._rows("_in", n)

    def scatter(self, block_ids: Sequence[int], payloads: Sequence[Payload]) -> None:
        """Payload j (host bytes: a uint8 numpy array or torch tensor, at least `row_bytes` long, in `gather`'s
        order; ideally `landing(n)[j]`) into block block_ids[j] of every layer. Done when this returns: the
        payloads may be reused."""
        ids = self._checked(block_ids)
        if len(payloads) != len(ids):
            raise ValueError(f"paged KV: {len(payloads)} payloads for {len(ids)} blocks")
        rows = [self._row_view(p, j) for j, p in enumerate(payloads)]
        if not ids:
            return
        if self.device.type == "cuda":
            self._scatter_cuda(ids, rows)
        else:
            page = self.page_bytes
            for b, src in zip(ids, rows):
                for i, pages in enumerate(self._pages):
                    pages[b].copy_(src[i * page:(i + 1) * page])

    def _scatter_cuda(self, ids: list[int], rows: list[torch.Tensor]) -> None:
        n, host, stage = len(ids), self._rows("_in", len(ids)), self._staging(len(ids))
        self._land(rows, host)
        index = torch.tensor(ids, dtype=torch.long).to(self.device)
        stage.view(n, self.row_bytes).copy_(host, non_blocking=True)
        for i, pages in enumerate(self._pages):
            pages.index_copy_(0, index, stage[:, i])
        torch.cuda.current_stream(self.device).synchronize()  # `host` and the payloads are free again

    def _land(self, rows: list[torch.Tensor], host: torch.Tensor) -> None:
        """Payload j into landing row j, unless it was read there; a payload in another landing row is copied
        out first (the copies would overwrite it before it is read)."""
        start, end = host.data_ptr(), self._in.data_ptr() + self._in.numel()
        moved = [j for j, src in enumerate(rows) if src.data_ptr() != host[j].data_ptr()]
        aliased = {j: rows[j].clone() for j in moved
                   if rows[j].data_ptr() < end and rows[j].data_ptr() + self.row_bytes > start}
        for j in moved:
            host[j].copy_(aliased.get(j, rows[j]))

    # -- buffers and checks --------------------------------------------------------------------------

    def _rows(self, attr: str, n: int) -> torch.Tensor:
        """The first `n` rows of a reusable host buffer (pinned for CUDA), grown to the largest batch.

        Page-aligned, as the tiers' own buffers are: a row of a multiple of 4 KiB goes to and from an O_DIRECT
        file tier in place."""
        buf = getattr(self, attr)
        if buf is None or buf.shape[0] < n:
            buf = aligned_host_tensor(n, self.row_bytes, pin=self.device.type == "cuda")
            setattr(self, attr, buf)
        return buf[:n]

    def _staging(self, n: int) -> torch.Tensor:
        if self._stage is None or self._stage.shape[0] < n:
            self._stage = None  # let the allocator reuse the old one's memory
            self._stage = torch.empty((n, self.layers, self.page_bytes), dtype=torch.uint8, device=self.device)
        return self._stage[:n]

    def _checked(self, block_ids: Sequence[int]) -> list[int]:
        """Ids as ints, all in range (an out-of-range index on CUDA would be a device-side assert)."""
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(f"paged KV: block ids {bad[:5]} outside [0, {self.num_blocks})")
        return ids

    def _row_view(self, payload: Payload, j: int) -> torch.Tensor:
        """The first `row_bytes` bytes of a host payload as a uint8 tensor sharing its memory."""
        if isinstance(payload, np.ndarray):
            if payload.dtype != np.uint8:
                raise TypeError(f"paged KV: payload {j} is a numpy {payload.dtype} array, not uint8")
            src = torch.from_numpy(np.ascontiguousarray(payload).reshape(-1))
        elif isinstance(payload, torch.Tensor):
            if payload.dtype != torch.uint8 or payload.device.type != "cpu":
                raise TypeError(f"paged KV: payload {j} is a {payload.dtype} tensor on {payload.device}, "
                                f"not uint8 host bytes")
            src = payload.reshape(-1)
        else:
            raise TypeError(f"paged KV: payload {j} is a {type(payload).__name__}, not a numpy array or tensor")
        if src.numel() < self.row_bytes:
            raise ValueError(f"paged KV: payload {j} holds {src.numel()} bytes, a block is {self.row_bytes}")
        return src[:self.row_bytes]


def _byte_pages(t: torch.Tensor, name: str, num_blocks: int, page_bytes: int, device: torch.device) -> torch.Tensor:
    """Layer `name`'s tensor as a `[num_blocks, page_bytes]` uint8 view of the same memory, or a ConfigError."""
    if t.device != device:
        raise ConfigError(f"paged KV: layer {name}'s KV tensor is on {t.device}, the first layer's on {device}")
    if t.dim() == 0 or t.shape[0] != num_blocks or t[0].nbytes != page_bytes or not t[0].is_contiguous():
        raise ConfigError(f"paged KV: layer {name}'s KV tensor {tuple(t.shape)} ({t.dtype}) is not "
                          f"[blocks={num_blocks}, ...] with contiguous {page_bytes}-byte blocks")
    try:
        pages = t.view(num_blocks, -1).view(torch.uint8)
    except RuntimeError as exc:
        raise ConfigError(f"paged KV: layer {name}'s KV tensor {tuple(t.shape)} cannot be viewed as byte pages: "
                          f"{exc}") from None
    assert pages.shape == (num_blocks, page_bytes) and pages.data_ptr() == t.data_ptr()
    return pages
