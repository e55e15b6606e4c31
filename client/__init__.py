"""The kvdepot client library. `from kvdepot.client import KVDepotClient`.

Names are imported on first use so that the operator CLI starts without
loading torch.
"""

_EXPORTS = {
    "KVDepotClient": "kvdepot.client.client",
    "LookupResult": "kvdepot.client.client",
    "JobResult": "kvdepot.client.jobs",
    "EngineHandle": "kvdepot.client.key_copy",
    "WorkerHandle": "kvdepot.client.workers",
    "block_keys": "kvdepot.keys",
    "OperatorClient": "kvdepot.client.cli",
    "Tls": "kvdepot.client.rpc",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvdepot.client' has no attribute {name!r}")
