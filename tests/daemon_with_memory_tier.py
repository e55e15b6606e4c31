"""kvdepotd with the tests' in-memory tier (memory_tier.py) stacked under the
kept pool and the disk: the daemon's own list of tiers, one entry longer.
$KVDEPOT_TEST_MEMORY_TIER_SHARDS sets its capacity. No setting of the real
daemon reaches this."""

import asyncio
import os
import sys

from memory_tier import MemoryTier

from kvdepot.server.daemon import main

_open_tiers = main.open_tiers


def _with_memory_tier(stack, config, pool):
    capacity = int(os.environ.get("KVDEPOT_TEST_MEMORY_TIER_SHARDS", "100000"))
    return [*_open_tiers(stack, config, pool), MemoryTier(pool, asyncio.get_running_loop(), capacity)]


main.open_tiers = _with_memory_tier
sys.exit(main.main())
