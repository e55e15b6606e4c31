"""kvdepot's SGLang integration: a HiCache storage backend (L3) on the node's kvdepotd,
as connector/ is the vLLM one. SGLang loads `kvdepot.sglang_backend.KVDepotStorage`
by name (README, "SGLang").

The class is imported on first use, so that host_pages.py (which needs no SGLang)
can be imported where SGLang is not installed."""

__all__ = ["KVDepotStorage"]


def __getattr__(name: str):
    if name == "KVDepotStorage":
        from kvdepot.sglang_backend.storage import KVDepotStorage

        return KVDepotStorage
    raise AttributeError(f"module 'kvdepot.sglang_backend' has no attribute {name!r}")
