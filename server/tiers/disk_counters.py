"""The disk tier's counters: what its store did since start, and what the
scan of its segment files found then.

DiskMover.stats turns them into the TierStats every tier reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScanCounts:
    """What a scan of the segment files found."""

    # Records indexed, those of cleared namespaces left out, and their data bytes.
    records: int = 0
    bytes: int = 0
    # Segments whose chain was followed, and files left in place, their space
    # not counted: unreadable, or not a sound segment of this format.
    segments: int = 0
    segments_skipped: int = 0
    # Chains that ended before their segment's end, at a header that is:
    # cut short or failing its checks (a write a crash interrupted),
    torn: int = 0
    # another format's,
    format: int = 0
    # or never sealed.
    empty: int = 0
    # Records of a namespace cleared after they were written.
    cleared: int = 0

    def ended_at(self, why: str) -> None:
        """Counts a chain ended at a header that shard_record.unpack refused for `why`."""
        if why == "format":
            self.format += 1
        elif why == "empty":
            self.empty += 1
        else:
            self.torn += 1

    def problems(self) -> str:
        """What a log line tells of a scan: what it could not follow."""
        return ", ".join(f"{n} {what}" for n, what in (
            (self.format, "format"), (self.torn, "torn"), (self.segments_skipped, "segments_skipped")) if n)


@dataclass
class DiskCounters:
    """The disk tier's counters (DiskTier.counters: a snapshot)."""

    # Now: records read() can serve, the segments' bytes on the filesystem
    # (what the capacity bounds), and segment files in use.
    records: int = 0
    bytes_used: int = 0
    segments: int = 0
    # Since start: record data bytes written and read back (headers and padding not counted),
    bytes_written: int = 0
    bytes_read: int = 0
    # segments evicted for room and the records that went with them,
    segments_evicted: int = 0
    records_evicted: int = 0
    # failed writes and segment syncs (each seals its segment),
    write_errors: int = 0
    # records dropped on read: for an I/O error, or for a header or data
    # that no longer match the record,
    read_errors: int = 0
    corrupt: int = 0
    # and records not written: larger than the capacity allows.
    too_large: int = 0
    # What the scan at start found.
    scan: ScanCounts = field(default_factory=ScanCounts)
