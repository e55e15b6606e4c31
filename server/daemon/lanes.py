"""Which lane runs the per-job path: the native one (server/native) where it
is built and can serve the configuration, else the Python one; --lane says
which to want."""

from __future__ import annotations

import contextlib
import logging
import os

from kvdepot import jobtrace
from kvdepot.server.daemon.config import DaemonConfig
from kvdepot.server.daemon.startup import StartupError
from kvdepot.server.host.pool import HostPool
from kvdepot.server.native import binding
from kvdepot.server.native.lane import MAX_TP, Lane

log = logging.getLogger("kvdepot")


def why_not_native(config: DaemonConfig, pool: HostPool) -> str:
    """Why this configuration needs the Python lane; '' if the native one serves it."""
    if config.limits.max_tp_size > MAX_TP:
        return f"--max-tp-size {config.limits.max_tp_size} is over the native lane's {MAX_TP}"
    if pool.pinned and config.copy.mode != "dma":
        return f"--copy-mode {config.copy.mode}: the native lane copies in dma mode"
    return ""


def open_lane(stack: contextlib.ExitStack, config: DaemonConfig, pool: HostPool) -> Lane | None:
    """The native lane, closed by `stack`, or None for the Python lane."""
    wanted = config.copy.lane
    if wanted == "python":
        log.info("per-job path: the Python lane (--lane python)")
        return None
    why = why_not_native(config, pool)
    library = None
    if not why:
        try:
            library = binding.load()
        except OSError as e:
            why = str(e)
    if why:
        if wanted == "native":
            raise StartupError(f"--lane native: {why}", 2)
        log.warning("per-job path: the Python lane, slower per job (%s)", why)
        return None
    lane = Lane(library, pool, arc=config.pool.eviction == "arc", tracing=jobtrace.ON,
                max_unread=config.limits.max_unread_job_replies,
                max_frame_bytes_per_uid=config.limits.max_job_frame_bytes_per_uid,
                check=os.environ.get("KVDEPOT_CHECK_INDEX") == "1")
    stack.callback(lane.close)
    log.info("per-job path: the native lane (%s)", binding.build.library_path().name)
    return lane
