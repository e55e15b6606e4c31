"""A pool's files: how the pool's one range of bytes is spread over them.

Page faults into one tmpfs file queue on that file's locks, so a large pool
is kept in several files, striped: the range is cut into stripes of `stripe`
bytes, and consecutive stripes are in different files, so that the threads
faulting in one chunk of the pool each fault a file of their own
(docs/benchmarks.md). The stripes are dealt out counting back from the last,
which goes to the first file (`name.pool`): the pool's last page, its header,
is then that file's last page, where `read_header` looks, and a pool of one
file is the file itself, laid out as before pools had several.

    range:  | s0 | s1 | s2 | s3 | s4 |        (parts = 2)
    name.pool    = s0 s2 s4     name.pool.1.TOKEN = s1 s3

Each later file's name ends in a random token of its own, which the header
keeps: in a folder others can write, one who sees a pool's first file appear
cannot take the names of the others first and so stop the daemon's start.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from dataclasses import dataclass

# Most files a pool may have (more than this in a header: not a pool of ours).
MAX_PARTS = 64
# Most stripes: each is a mapping of its own (neighbours are other files'), and
# a process has vm.max_map_count of them (65,530 by default) for everything.
MAX_STRIPES = 4096
TOKEN_BYTES = 8
_PART_NAME = re.compile(r"\.pool\.[1-9][0-9]?\.[0-9a-f]{16}$")


@dataclass(frozen=True)
class Layout:
    """`size` bytes (a whole number of pages) in `parts` files, striped by
    `stripe` bytes (0 when there is one file); `tokens` end the later files'
    names (16 hex digits each)."""

    size: int
    parts: int = 1
    stripe: int = 0
    tokens: tuple[str, ...] = ()

    def why_not(self, page: int = 4096) -> str:
        """Why these numbers are no layout ('' when they are one). A header's
        fields are checked here before any arithmetic uses them."""
        if self.size <= 0 or self.size % page:
            return f"a size of {self.size} bytes, not a whole number of {page}-byte pages"
        if self.parts == 1:
            return "" if self.stripe == 0 else "a stripe with one file"
        if not 1 < self.parts <= MAX_PARTS:
            return f"{self.parts} files (at most {MAX_PARTS})"
        if self.stripe <= 0 or self.stripe % page:
            return f"stripes of {self.stripe} bytes, not a whole number of {page}-byte pages"
        if self.stripes < self.parts:
            return f"{self.stripes} stripes over {self.parts} files"
        if self.stripes > MAX_STRIPES:
            return f"{self.stripes} stripes (at most {MAX_STRIPES})"
        if len(self.tokens) != self.parts - 1 or not all(re.fullmatch("[0-9a-f]{16}", t) for t in self.tokens):
            return f"names for {len(self.tokens)} later files of {self.parts}"
        return ""

    @property
    def stripes(self) -> int:
        return -(-self.size // self.stripe) if self.parts > 1 else 1

    def _part_of(self, k: int) -> int:
        return (self.stripes - 1 - k) % self.parts

    def _first_stripe_of(self, part: int) -> int:
        return (self.stripes - 1 - part) % self.parts

    def pieces(self, offset: int = 0, length: int | None = None) -> list[tuple[int, int, int, int]]:
        """(offset in the range, length, file, offset in that file) of each
        stripe's part within [offset, offset + length), in order."""
        end = self.size if length is None else min(self.size, offset + length)
        if self.parts == 1:
            return [(offset, end - offset, 0, offset)] if end > offset else []
        out = []
        k = offset // self.stripe
        at = offset
        while at < end:
            stop = min(end, (k + 1) * self.stripe)
            part = self._part_of(k)
            index = (k - self._first_stripe_of(part)) // self.parts
            out.append((at, stop - at, part, index * self.stripe + at - k * self.stripe))
            at, k = stop, k + 1
        return out

    def part_sizes(self) -> list[int]:
        """Each file's size in bytes; the first ends with the range's last page."""
        if self.parts == 1:
            return [self.size]
        sizes = []
        for part in range(self.parts):
            count = (self.stripes - 1 - self._first_stripe_of(part)) // self.parts + 1
            sizes.append(count * self.stripe)
        sizes[0] -= self.stripes * self.stripe - self.size  # the last stripe is the short one
        return sizes


def striped(size: int, files: int, stripe: int, page: int = 4096) -> Layout:
    """`files` files (at most one per stripe) of `stripe` bytes, or of more
    where that would make more than MAX_STRIPES, named anew; one file when
    that leaves one."""
    stripe = max(stripe, -(-size // MAX_STRIPES // page) * page)
    files = min(files, -(-size // stripe), MAX_PARTS)
    if files < 2:
        return Layout(size)
    return Layout(size, files, stripe, tuple(secrets.token_hex(TOKEN_BYTES) for _ in range(files - 1)))


def part_path(pool_path: str, layout: Layout, part: int) -> str:
    """The file holding `part` of the pool named `pool_path` (the first is that name)."""
    return pool_path if part == 0 else f"{pool_path}.{part}.{layout.tokens[part - 1]}"


def is_part_name(name: str) -> bool:
    """Whether `name` is a pool's second or later file (`x.pool.N.TOKEN`)."""
    return bool(_PART_NAME.search(name))


def first_file_name(part_name: str) -> str:
    """The name of the first file of the pool whose later file is `part_name`."""
    return part_name[: part_name.rindex(".pool.") + len(".pool")]


def present_parts(pool_path: str) -> list[str]:
    """Paths of this user's files that are later parts of the pool at
    `pool_path`, whatever its header says: what goes when the pool goes."""
    folder, base = os.path.split(pool_path)
    found = []
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    for name in names:
        if name.startswith(base + ".") and is_part_name(name) and own_plain_file(os.path.join(folder, name)):
            found.append(os.path.join(folder, name))
    return sorted(found)


def own_plain_file(path: str) -> bool:
    """Whether `path` (not followed) is a plain file of this user's: what a cleanup may remove."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode)


def why_not_alone(st: os.stat_result) -> str:
    """Why a pool's file (its stat, not followed) is not this user's alone ('' when it is):
    bytes another user could have written would reach the GPUs."""
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return "is not a plain file with one name"
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return f"belongs to uid {st.st_uid} with mode {st.st_mode & 0o777:o}, not to this user alone"
    return ""


def parts_bytes(pool_path: str) -> int:
    """RAM the later parts of a pool hold."""
    total = 0
    for path in present_parts(pool_path):
        try:
            total += os.lstat(path).st_blocks * 512
        except OSError:
            pass
    return total


def why_parts_unusable(pool_path: str, layout: Layout) -> str:
    """Why the later files of a pool cannot be adopted ('' when each is this
    user's alone, with one name and its size)."""
    sizes = layout.part_sizes()
    for part in range(1, layout.parts):
        path = part_path(pool_path, layout, part)
        try:
            st = os.lstat(path)
        except OSError as e:
            return f"its file {path} cannot be read ({e.strerror})"
        if why := why_not_alone(st):
            return f"its file {path} {why}"
        if st.st_size != sizes[part]:
            return f"its file {path} has {st.st_size} bytes where the header makes {sizes[part]}"
    return ""


def remove_parts(pool_path: str) -> None:
    """Removes the later files of the pool at `pool_path` (its first file is the caller's)."""
    for path in present_parts(pool_path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
