"""The tiers under the block index: the pool kept across restarts (warm.py)
and a local disk (disk.py). Both store shards as self-describing records
(record.py) whose namespaces the catalog (catalog.py) names."""
