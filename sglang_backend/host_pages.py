"""An SGLang host pool's pages as a kvdepot worker's blocks.

SGLang's HiCache host pool (`HostKVCache`) keeps the KV of every page of
`page_size` tokens in one tensor, `kv_buffer`, laid out by `layout`. A page is
one kvdepot block: this module views `kv_buffer` with a dimension of pages
(no copy), so that the client's shared-memory transport copies whole pages
between the pool and the daemon, and names the layout for the namespace.

Layouts, as SGLang 0.5's MHA and MLA host pools allocate them (`init_kv_buffer`):

| layout            | MHA kv_buffer                | MLA kv_buffer            |
| ----------------- | ---------------------------- | ------------------------ |
| layer_first       | [2, layers, tokens, H, D]    | [layers, tokens, 1, d]   |
| page_first        | [2, tokens, layers, H, D]    | [tokens, layers, 1, d]   |
| page_first_direct | [2, pages, layers, ps, H, D] | [pages, layers, ps, 1, d]|
| page_head         | [2, pages, H, ps, layers, D] | (none)                   |

A token dimension becomes [pages, page_size]; the dimensions before the page
dimension are the block's pages in kvdepot's sense (kvdepot/layout.py), and a
block's bytes in a slot are then in the order of SGLang's own flat data page
(`get_data_page(index, flat=True)`). Other layouts (page_unified, split
K/V buffers, lists of per-layer buffers) are refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdepot.errors import InvalidArgument

# Where the token or page dimension of kv_buffer is, by (MLA, layout):
# ("tokens", d) is a token dimension, ("pages", d) already a page dimension.
# The third item is kv_buffer's number of dimensions in that layout.
_PAGE_DIMS = {
    (False, "layer_first"): ("tokens", 2, 5),
    (False, "page_first"): ("tokens", 1, 5),
    (False, "page_first_direct"): ("pages", 1, 6),
    (False, "page_head"): ("pages", 1, 6),
    (True, "layer_first"): ("tokens", 1, 4),
    (True, "page_first"): ("tokens", 0, 4),
    (True, "page_first_direct"): ("pages", 0, 5),
}
# Pages compared with the pool's own get_data_page at registration.
CHECKED_PAGES = 3
SUPPORTED_LAYOUTS = sorted({layout for _, layout in _PAGE_DIMS})


@dataclass(frozen=True)
class HostPages:
    # kv_buffer viewed with a dimension of pages (shares its memory).
    tensor: torch.Tensor
    block_dim: int
    page_size: int
    num_pages: int
    layout: str
    mla: bool

    @property
    def namespace_layout(self) -> str:
        """What the namespace's layout field says: pages of two layouts never meet."""
        return f"sglang:{self.layout}" + (":mla" if self.mla else "")

    def page(self, index: int) -> torch.Tensor:
        """Page `index` as a view, in the order of SGLang's flat data page."""
        return self.tensor.select(self.block_dim, index)


def host_pages(host_pool, mla: bool) -> HostPages:
    """The pages of an SGLang host pool, or InvalidArgument saying why it cannot be served."""
    layout = getattr(host_pool, "layout", None)
    page_size = int(getattr(host_pool, "page_size", 0) or 0)
    buffer = getattr(host_pool, "kv_buffer", None)
    kind = "MLA" if mla else "MHA"
    if (mla, layout) not in _PAGE_DIMS:
        raise InvalidArgument(
            f"kvdepot serves SGLang's {kind} host pools in the layouts "
            f"{', '.join(name for m, name in _PAGE_DIMS if m == mla)}, not {layout!r}: start SGLang with "
            "--hicache-mem-layout page_first (or layer_first)"
        )
    if not isinstance(buffer, torch.Tensor):
        raise InvalidArgument(
            f"this SGLang host pool ({type(host_pool).__name__}) keeps its KV in {type(buffer).__name__}, "
            "not one tensor: kvdepot cannot serve it"
        )
    if buffer.device.type != "cpu":
        raise InvalidArgument(f"the host pool's kv_buffer is on {buffer.device}, not in host memory")
    if page_size < 1:
        raise InvalidArgument(f"the host pool's page_size is {page_size}")
    what, dim, ndim = _PAGE_DIMS[(mla, layout)]
    if buffer.dim() != ndim:
        raise InvalidArgument(
            f"this SGLang host pool ({type(host_pool).__name__}) has a kv_buffer of shape {tuple(buffer.shape)}, "
            f"not the {ndim} dimensions of SGLang's {kind} {layout}: kvdepot cannot serve it"
        )
    shape, strides = list(buffer.shape), list(buffer.stride())
    if what == "tokens":
        num_pages = shape[dim] // page_size
        if num_pages < 1:
            raise InvalidArgument(f"the host pool holds {shape[dim]} tokens, less than a page of {page_size}")
        shape[dim : dim + 1] = [num_pages, page_size]
        strides[dim : dim + 1] = [strides[dim] * page_size, strides[dim]]
        tensor = buffer.as_strided(shape, strides, buffer.storage_offset())
    else:
        num_pages = shape[dim]
        tensor = buffer
    pages = HostPages(tensor, dim, page_size, num_pages, layout, mla)
    _check_against_pool(pages, host_pool)
    return pages


def _check_against_pool(pages: HostPages, host_pool) -> None:
    """The view's pages are the pool's own (`get_data_page`), same memory and bytes, or the
    pool is refused: a pool class with another layout under a known name (extra scale
    buffers, packed rows) would otherwise be stored as wrong bytes under real keys."""
    name = type(host_pool).__name__
    for index in sorted({0, min(1, pages.num_pages - 1), pages.num_pages - 1})[:CHECKED_PAGES]:
        try:
            theirs = host_pool.get_data_page(index * pages.page_size, flat=False)
        except Exception as e:
            raise InvalidArgument(f"this SGLang host pool ({name}) gives no data page: {e}") from None
        ours = pages.page(index)
        if (
            not isinstance(theirs, torch.Tensor)
            or theirs.data_ptr() != ours.data_ptr()
            or theirs.numel() != ours.numel()
            or not torch.equal(theirs.flatten(), ours.flatten())
        ):
            raise InvalidArgument(
                f"this SGLang host pool ({name}) lays its pages out otherwise than SGLang's {pages.layout}: "
                "kvdepot cannot serve it"
            )


def page_ids(host_indices: torch.Tensor, count: int, page_size: int, num_pages: int) -> list[int] | None:
    """The host pool's page of each of `count` pages of token indices, or None
    when they are not whole pages in order (SGLang allocates them so; anything
    else is refused rather than copied to the wrong place)."""
    if host_indices is None or host_indices.numel() != count * page_size:
        return None
    firsts = host_indices.reshape(count, page_size)
    starts = firsts[:, 0]
    if count and (bool((starts % page_size != 0).any()) or int(starts.min()) < 0):
        return None
    expected = starts.unsqueeze(1) + torch.arange(page_size, dtype=host_indices.dtype)
    if not torch.equal(firsts, expected):
        return None
    ids = (starts // page_size).tolist()
    if ids and max(ids) >= num_pages:
        return None
    return ids
