"""PagedKV: blocks between per-layer paged KV tensors and host rows, in the connector's payload byte order.

Runs on CPU tensors (the CUDA branch differs only in where the batch is staged; the GPU check measures it).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvcluster.errors import ConfigError
from kvcluster.integrations.vllm.paged_kv import PagedKV

BLOCKS, LAYERS = 10, 3
SHAPE = (2, 4, 8)  # per block: K and V, 4 tokens, 8 values (bf16: 128 bytes a page)
PAGE = 2 * 4 * 8 * 2
NAMES = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]


def paged(seed: int = 0, dtype=torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((BLOCKS, *SHAPE), generator=g).to(dtype) for _ in range(LAYERS)]


def page_bytes(t: torch.Tensor, b: int) -> bytes:
    return t[b].contiguous().view(torch.uint8).numpy().tobytes()


def test_gather_rows_are_each_layers_page_in_order() -> None:
    layers = paged()
    kv = PagedKV(layers, NAMES, BLOCKS, PAGE)
    assert kv.row_bytes == LAYERS * PAGE == 384
    rows = kv.gather([7, 2, 5])
    assert rows.shape == (3, 384) and rows.dtype == torch.uint8 and rows.device.type == "cpu"
    for j, b in enumerate([7, 2, 5]):  # the old per-layer concatenation, built by hand
        assert rows[j].numpy().tobytes() == b"".join(page_bytes(t, b) for t in layers)
    assert kv.gather([]).shape == (0, 384)


def test_a_blocks_pages_are_its_row_in_order_and_lie_in_the_registered_regions() -> None:
    """What a transfer engine writes straight into: block b's pages, layer 0 first, concatenate to its gathered
    row, and each is a view of its layer's region (the memory registered with NIXL)."""
    layers = paged(3)
    kv = PagedKV(layers, NAMES, BLOCKS, PAGE)
    row = kv.gather([6])[0]
    pages = kv.block_pages(6)
    assert len(pages) == LAYERS and all(p.dtype == torch.uint8 and p.numel() == PAGE for p in pages)
    assert torch.equal(torch.cat(pages), row)
    for p, region, t in zip(pages, kv.regions, layers):
        assert region.data_ptr() == t.data_ptr() and region.shape == (BLOCKS, PAGE)
        assert p.data_ptr() == region[6].data_ptr()
    with pytest.raises(IndexError, match="outside"):
        kv.block_pages(BLOCKS)


def test_round_trip_between_two_caches_is_exact() -> None:
    src, dst = paged(1), [torch.zeros((BLOCKS, *SHAPE), dtype=torch.bfloat16) for _ in range(LAYERS)]
    a, b = PagedKV(src, NAMES, BLOCKS, PAGE), PagedKV(dst, NAMES, BLOCKS, PAGE)
    ids = [9, 0, 4, 6]
    rows = a.gather(ids)
    b.scatter([1, 3, 8, 2], [r.numpy() for r in rows])  # numpy views of the host rows, as the connector stores
    for s, d in zip(src, dst):
        for i, j in zip(ids, [1, 3, 8, 2]):
            assert torch.equal(d[j].view(torch.uint8), s[i].view(torch.uint8))
    assert all(not d[[0, 4, 5, 6, 7, 9]].view(torch.uint8).any() for d in dst)  # other blocks untouched
    assert np.array_equal(b.gather([1, 3, 8, 2]).numpy(), a.gather(ids).numpy())
    landing = b.landing(2)  # host rows to read payloads into, then scatter
    landing.copy_(a.gather([5, 7]))
    b.scatter([0, 9], [landing[0], landing[1]])
    assert np.array_equal(b.gather([0, 9]).numpy(), a.gather([5, 7]).numpy())


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_scatter_of_numpy_and_torch_payloads_then_gather_of_scattered_ids(kind: str) -> None:
    layers = paged(2)
    before = [t.clone() for t in layers]
    kv = PagedKV(layers, NAMES, BLOCKS, PAGE)
    rng = np.random.default_rng(3)
    ids = [8, 1, 5]  # not contiguous, not sorted
    payloads = [rng.integers(0, 256, kv.row_bytes + 16, dtype=np.uint8) for _ in ids]  # longer than a row: ok
    given = payloads if kind == "numpy" else [torch.from_numpy(p.copy()) for p in payloads]
    kv.scatter(ids, given)
    got = kv.gather(ids).numpy()
    for j, p in enumerate(payloads):
        assert got[j].tobytes() == p[:kv.row_bytes].tobytes()
        for i, t in enumerate(layers):
            assert t[ids[j]].view(torch.uint8).numpy().tobytes() == p[i * PAGE:(i + 1) * PAGE].tobytes()
    for t, old in zip(layers, before):
        keep = [b for b in range(BLOCKS) if b not in ids]
        assert torch.equal(t[keep].view(torch.uint8), old[keep].view(torch.uint8))


def test_gather_reuses_its_rows_and_grows_for_a_larger_batch() -> None:
    layers = paged(4, torch.float32)
    kv = PagedKV(layers, NAMES, BLOCKS, 2 * 4 * 8 * 4)
    first = kv.gather([0, 1])
    again = kv.gather([3])
    assert again.data_ptr() == first.data_ptr()  # the same buffer: rows are valid until the next gather
    assert first[0].numpy().tobytes() == b"".join(page_bytes(t, 3) for t in layers)
    big = kv.gather(list(range(BLOCKS)))
    assert big.shape[0] == BLOCKS
    assert big[9].numpy().tobytes() == b"".join(page_bytes(t, 9) for t in layers)


def test_rows_of_whole_pages_are_page_aligned_for_o_direct_tiers() -> None:
    layers = [torch.zeros((4, 2, 8, 64)) for _ in range(2)]  # 4 KiB float32 pages
    kv = PagedKV(layers, NAMES[:2], 4, 4096)
    assert [r.data_ptr() % 4096 for r in kv.gather([3, 0, 2])] == [0, 0, 0]
    assert [r.data_ptr() % 4096 for r in kv.landing(4)] == [0, 0, 0, 0]


def test_blocks_strided_in_a_larger_tensor_are_viewed_not_copied() -> None:
    """A layer whose blocks are contiguous but spaced out (a view of every other block of a bigger tensor)."""
    big = [torch.randn((2 * BLOCKS, *SHAPE)).to(torch.bfloat16) for _ in range(LAYERS)]
    layers = [t[::2] for t in big]
    kv = PagedKV(layers, NAMES, BLOCKS, PAGE)
    payload = np.arange(kv.row_bytes, dtype=np.uint64).astype(np.uint8)
    kv.scatter([3], [payload])
    assert big[2][6].view(torch.uint8).numpy().tobytes() == payload[2 * PAGE:3 * PAGE].tobytes()
    assert kv.gather([3])[0].numpy().tobytes() == payload.tobytes()


@pytest.mark.parametrize("layer, tensor", [
    (1, torch.zeros((BLOCKS + 1, *SHAPE), dtype=torch.bfloat16)),  # wrong block count
    (2, torch.zeros((BLOCKS, 2, 4, 4), dtype=torch.bfloat16)),  # wrong page size
    (0, torch.zeros((BLOCKS, 8, 4, 2), dtype=torch.bfloat16).transpose(1, 3)),  # a page that is not contiguous
    (2, torch.zeros((), dtype=torch.bfloat16)),  # a scalar
])
def test_a_bad_layer_tensor_is_a_config_error_naming_the_layer(layer: int, tensor: torch.Tensor) -> None:
    layers = paged()
    layers[layer] = tensor
    expected = f"paged KV: layer {NAMES[layer]}'s KV tensor {tuple(tensor.shape)} (torch.bfloat16) is not " \
               f"[blocks=10, ...] with contiguous 128-byte blocks"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        PagedKV(layers, NAMES, BLOCKS, PAGE)


def test_layers_on_two_devices_are_a_config_error_naming_the_layer() -> None:
    layers = paged()
    layers[1] = torch.empty((BLOCKS, *SHAPE), dtype=torch.bfloat16, device="meta")
    expected = f"layer {NAMES[1]}'s KV tensor is on meta, the first layer's on cpu"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        PagedKV(layers, NAMES, BLOCKS, PAGE)


def test_bad_ids_and_payloads_are_clear_errors() -> None:
    kv = PagedKV(paged(), NAMES, BLOCKS, PAGE)
    with pytest.raises(IndexError, match=r"block ids \[10\] outside \[0, 10\)"):
        kv.gather([1, 10])
    with pytest.raises(IndexError, match=r"block ids \[-1\]"):
        kv.scatter([-1], [np.zeros(kv.row_bytes, np.uint8)])
    with pytest.raises(ValueError, match="payload 0 holds 383 bytes, a block is 384"):
        kv.scatter([0], [np.zeros(kv.row_bytes - 1, np.uint8)])
    with pytest.raises(TypeError, match="numpy float32 array, not uint8"):
        kv.scatter([0], [np.zeros(kv.row_bytes, np.float32)])
    with pytest.raises(ValueError, match="2 payloads for 1 blocks"):
        kv.scatter([0], [np.zeros(kv.row_bytes, np.uint8)] * 2)
    with pytest.raises(ConfigError, match="2 tensors for 3 layer names"):
        PagedKV(paged()[:2], NAMES, BLOCKS, PAGE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA branch needs a CUDA device")
def test_cuda_branch_matches_the_cpu_branch() -> None:
    host = paged(5)
    dev = [t.cuda() for t in host]
    on_host, on_dev = PagedKV(host, NAMES, BLOCKS, PAGE), PagedKV(dev, NAMES, BLOCKS, PAGE)
    ids = [9, 2, 4, 0]
    rows = on_dev.gather(ids)
    assert rows.device.type == "cpu" and rows.is_pinned()
    assert np.array_equal(rows.numpy(), on_host.gather(ids).numpy())
    payloads = [np.random.default_rng(j).integers(0, 256, on_dev.row_bytes, dtype=np.uint8) for j in range(3)]
    on_dev.scatter([7, 1, 5], payloads)
    on_host.scatter([7, 1, 5], [torch.from_numpy(p) for p in payloads])
    for d, h in zip(dev, host):
        assert torch.equal(d.cpu().view(torch.uint8), h.view(torch.uint8))
    landing = on_dev.landing(3)
    assert landing.is_pinned()
    for j, p in enumerate(payloads):  # read into the landing rows, as a tier read with `out` does
        landing[j].copy_(torch.from_numpy(p))
    on_dev.scatter([0, 2, 3], [landing[j].numpy() for j in range(3)])  # in place: no host copy
    on_dev.scatter([4, 6, 8], [landing[2], landing[0], landing[1]])  # landing rows out of order: copied out first
    on_host.scatter([0, 2, 3, 4, 6, 8], [payloads[j] for j in (0, 1, 2, 2, 0, 1)])
    for d, h in zip(dev, host):
        assert torch.equal(d.cpu().view(torch.uint8), h.view(torch.uint8))
