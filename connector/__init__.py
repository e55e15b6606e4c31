"""kvdepot's vLLM connector: `kv_connector_module_path = "kvdepot.connector"`, class `KVDepotConnector`."""

from kvdepot.connector.connector import KVDepotConnector

__all__ = ["KVDepotConnector"]
