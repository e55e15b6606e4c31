"""A pool kept in several files, striped (kvdepot/pool_parts.py): every byte
of the range lives in exactly one place of one file, the header stays at the
end of the file `kvdepot pools` lists, blocks come back bit-exact after a
restart, and a later file that is not the daemon user's alone is never adopted."""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env, wait_until
from kvcache import attach_worker, block_of, dram, prompt_keys
from test_local_users import shared_tmp  # noqa: F401 (a fixture)
from test_trust import NOBODY, as_uid, needs_second_uid
from test_warm_restart import flip

from kvdepot import kept_pools
from kvdepot.pool_parts import MAX_STRIPES, Layout, part_path, striped
from kvdepot.server.host.pool import HostPool
from kvdepot.server.host.pool_map import reserve

PAGE = 4096
SLOT_BYTES = 16 * 1024  # the test daemons' slot size
RECORD_BYTES = 128


def pool_range(path: Path) -> bytearray:
    """The pool's range as the daemon maps it, put together from its files."""
    header, why = kept_pools.read_header(str(path))
    assert header, why
    layout = header["layout"]
    data = bytearray(layout.size)
    for offset, length, part, file_offset in layout.pieces():
        with open(part_path(str(path), layout, part), "rb") as f:
            f.seek(file_offset)
            data[offset : offset + length] = f.read(length)
    return data


def file_and_offset(path: Path, offset: int) -> tuple[str, int]:
    """The file, and the offset in it, holding byte `offset` of the pool's range."""
    header, _ = kept_pools.read_header(str(path))
    [(_, _, part, file_offset)] = header["layout"].pieces(offset, 1)
    return part_path(str(path), header["layout"], part), file_offset


def slot_of(data: bytes, key: bytes) -> int:
    num_slots = (len(data) - 4096) // (SLOT_BYTES + RECORD_BYTES)
    for slot in range(num_slots):
        at = num_slots * SLOT_BYTES + slot * RECORD_BYTES + 40
        if data[at : at + 32] == key:
            return slot
    raise AssertionError("no record names the key")


# ------------------------------------------------------------ the layout


@pytest.mark.parametrize("seed", range(200))
def test_each_byte_of_the_range_is_in_one_place_and_the_last_page_ends_the_first_file(seed):
    rng = random.Random(seed)
    stripe = rng.randint(1, 8) * PAGE
    size = rng.randint(1, 64) * PAGE
    layout = striped(size, rng.randint(1, 20), stripe)
    assert not layout.why_not()
    sizes = layout.part_sizes()
    covered = [bytearray(s) for s in sizes]
    pieces = layout.pieces()
    # The pieces tile the range in order.
    assert [p[0] for p in pieces] == [0, *[p[0] + p[1] for p in pieces[:-1]]]
    assert pieces[-1][0] + pieces[-1][1] == size
    for _, length, part, file_offset in pieces:
        assert 0 < length <= (layout.stripe or size) and file_offset + length <= sizes[part]
        for i in range(file_offset, file_offset + length):
            covered[part][i] += 1
    assert all(set(c) == {1} for c in covered), "a byte of a file held twice or never"
    # Neighbouring stripes are in different files: threads faulting them do not queue on one.
    assert all(a[2] != b[2] for a, b in zip(pieces, pieces[1:]))
    [(_, _, part, file_offset)] = layout.pieces(size - PAGE, PAGE)
    assert (part, file_offset) == (0, sizes[0] - PAGE)
    # A window's pieces are the whole range's, cut to it.
    start = rng.randrange(size)
    window = layout.pieces(start, rng.randint(1, size))
    assert window[0][0] == start
    for offset, length, part, file_offset in window:
        [(whole_at, whole_length, whole_part, whole_file_at)] = [p for p in pieces if p[0] <= offset < p[0] + p[1]]
        assert part == whole_part and file_offset == whole_file_at + offset - whole_at
        assert offset + length <= whole_at + whole_length


@pytest.mark.parametrize("layout, why", [
    (Layout(3 << 20, 0, 1 << 20), "0 files"),
    (Layout(3 << 20, 65, 1 << 20), "65 files"),
    (Layout(3 << 20, 2, 0), "stripes of 0 bytes"),
    (Layout(3 << 20, 2, 1000), "stripes of 1000 bytes"),
    (Layout(3 << 20, 4, 1 << 20), "3 stripes over 4 files"),
    (Layout(3 << 20, 1, 1 << 20), "a stripe with one file"),
    (Layout(1000), "not a whole number"),
    (Layout(-PAGE, 2, PAGE), "not a whole number"),
    (Layout(3 << 20, 2, 1 << 20), "names for 0 later files of 2"),
    (Layout(3 << 20, 2, 1 << 20, ("../../etc/passwd",)), "names for 1 later files of 2"),
])
def test_a_layout_that_cannot_be_is_named_before_any_arithmetic(layout, why):
    assert why in layout.why_not()


# ------------------------------------------------------------ the pool


def test_a_pool_in_four_files_keeps_its_bytes_across_a_close_and_adoption(tmp_path):
    pool = HostPool(size=4 << 20, slot_bytes=SLOT_BYTES, directory=str(tmp_path), name="kvdepot-t", pin="off",
                    files=4, address="unix:/x.sock")
    assert pool.layout.parts == 4
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == "kvdepot-t.pool" and len(names) == 4
    # Each later file's name ends in a token of its own: seeing one names none of the others.
    assert all(re.fullmatch(rf"kvdepot-t\.pool\.{k}\.[0-9a-f]{{16}}", n) for k, n in enumerate(names[1:], 1))
    assert len({n.rsplit(".", 1)[1] for n in names[1:]}) == 3
    assert all((tmp_path / n).stat().st_mode & 0o777 == 0o600 for n in names)
    rng = random.Random(1)
    written = {slot: rng.randbytes(SLOT_BYTES) for slot in rng.sample(range(pool.num_slots), 40)}
    for slot, data in written.items():
        pool.slot_view(slot, SLOT_BYTES)[:] = data
    pool.close()
    data = pool_range(tmp_path / "kvdepot-t.pool")
    for slot, expected in written.items():
        assert data[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES] == expected, f"slot {slot}"
    header, why = kept_pools.read_header(str(tmp_path / "kvdepot-t.pool"))
    assert header["address"] == "unix:/x.sock" and header["kept_at"] > 0 and header["layout"] == pool.layout
    [kept] = kept_pools.kept_pools([str(tmp_path)])
    assert kept.bytes >= sum(os.stat(tmp_path / n).st_blocks * 512 for n in names) > 4 << 20

    again = HostPool(size=4 << 20, slot_bytes=SLOT_BYTES, directory=str(tmp_path), name="kvdepot-t", pin="off",
                     adopt=True)
    assert again.layout == pool.layout
    for slot, expected in written.items():
        assert bytes(again.slot_view(slot, SLOT_BYTES)) == expected
    again.close(discard=True)
    assert list(tmp_path.iterdir()) == []


def test_a_big_pool_is_striped_by_default_and_a_small_one_is_one_file(tmp_path):
    small = HostPool(size=8 << 20, slot_bytes=SLOT_BYTES, directory=str(tmp_path), name="kvdepot-s", pin="off")
    assert small.layout == Layout(small.layout.size)
    small.close(discard=True)
    # Only the arithmetic for big ones: a 4 GiB file would not fit every test machine's tmpfs.
    big = striped(4 << 30, 16, 64 << 20)
    assert big.parts == 16 and big.stripe == 64 << 20 and max(big.part_sizes()) <= 257 << 20
    # A stripe is a mapping of its own: a pool of TiB takes larger stripes, not more mappings.
    for size in (1 << 40, 4 << 40, (16 << 40) + PAGE):
        layout = striped(size, 16, 64 << 20)
        assert not layout.why_not() and layout.stripes <= MAX_STRIPES and layout.parts == 16
    assert "4097 stripes (at most 4096)" in Layout(4097 * PAGE, 2, PAGE, ("0" * 16,)).why_not()


def vm_flags(start: int, end: int) -> list[list[str]]:
    """The VmFlags of each mapping of this process within [start, end)."""
    flags, inside = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                inside = low < end and high > start
            elif line.startswith("VmFlags:") and inside:
                flags.append(line.split()[1:])
    return flags


def test_the_range_of_a_striped_pool_takes_no_commit_charge(tmp_path):
    """Under vm.overcommit_memory=2 a private writable mapping takes its size
    from the commit limit at once (MAP_NORESERVE is ignored there): the range
    the files are mapped into is reserved shared ("sh"), and what is mapped
    into it is the files, shared too."""
    reserved = reserve(1 << 30)
    base = ctypes.addressof(ctypes.c_char.from_buffer(reserved))
    try:
        [flags] = vm_flags(base, base + (1 << 30))
    finally:
        reserved.close()
    assert "sh" in flags and "ac" not in flags, flags
    pool = HostPool(size=4 << 20, slot_bytes=SLOT_BYTES, directory=str(tmp_path), name="kvdepot-c", pin="off",
                    files=4)
    mapped = vm_flags(pool.base_address, pool.base_address + pool.layout.size)
    pool.close(discard=True)
    assert len(mapped) >= 4 and all("sh" in f and "ac" not in f for f in mapped), mapped


# ------------------------------------------------------------ the daemon


def store(client, worker, keys):
    job = client.submit_store(worker, 1, keys, list(range(len(keys))))
    assert client.wait([job], 10)[job].ok


def test_blocks_in_a_striped_pool_come_back_bit_exact_after_kill_9_and_a_flipped_one_does_not(
        start_daemon, client_factory):
    # 16 files of a 4 MiB pool: stripes of 256 KiB, so that 24 blocks of 16 KiB span several files.
    daemon = start_daemon(pool_files=16)
    assert "and 15 more files beside it" in daemon.log()
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=11)
    keys = prompt_keys(24, prompt=12)
    store(client, worker, keys)
    wait_until(lambda: dram(client.stats()).written_shards >= 24, what="24 records sealed")
    daemon.kill()
    [pool] = daemon.folder.glob("*.pool")
    data = pool_range(pool)
    slots = [slot_of(data, key) for key in keys]
    parts = {file_and_offset(pool, slot * SLOT_BYTES)[0] for slot in slots}
    assert len(parts) > 1, "the blocks all went into one file"
    # A byte of block 7's KV, in whichever file holds it.
    flip(*file_and_offset(pool, slots[7] * SLOT_BYTES + 100))
    daemon.start()
    assert client.wait_connected(15)
    tier = dram(client.stats())
    assert tier.recovered_shards == 23 and dict(tier.discarded) == {"data_hash": 1}
    assert client.lookup(engine, keys[:7]).ready_blocks == 7
    assert client.lookup(engine, keys[7:8]).ready_blocks == 0
    job = client.submit_load(worker, 2, keys[8:24], list(range(40, 56)))
    assert client.wait([job], 10)[job].ok
    for i in range(16):
        for src, dst in zip(block_of(tensors, "per_layer", 8 + i), block_of(tensors, "per_layer", 40 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16)), f"block {8 + i} differs"


@pytest.mark.parametrize("tamper", ["symlink", "mode", "missing", "short"])
def test_a_later_file_not_this_users_alone_is_never_adopted(start_daemon, client_factory, tmp_path, tamper):
    daemon = start_daemon(pool_files=4)
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=13)
    keys = prompt_keys(8, prompt=14)
    store(client, worker, keys)
    assert daemon.stop() == 0
    [pool] = daemon.folder.glob("*.pool")
    layout = kept_pools.read_header(str(pool))[0]["layout"]
    second = Path(part_path(str(pool), layout, 2))
    planted = tmp_path / "planted"
    planted.write_bytes(second.read_bytes())
    # Another process changes the kept pool's third file behind the daemon's back.
    change = {
        "symlink": f"import os; os.unlink({str(second)!r}); os.symlink({str(planted)!r}, {str(second)!r})",
        "mode": f"import os; os.chmod({str(second)!r}, 0o660)",
        "missing": f"import os; os.unlink({str(second)!r})",
        "short": f"import os; os.truncate({str(second)!r}, 4096)",
    }[tamper]
    subprocess.run([sys.executable, "-c", change], check=True, timeout=30)
    before = planted.read_bytes()
    daemon.start()
    assert "not adopting the pool" in daemon.log() and "its file" in daemon.log()
    assert client.wait_connected(15)
    assert client.lookup(engine, keys).ready_blocks == 0
    assert planted.read_bytes() == before  # never written through the link
    new = list(daemon.folder.glob("*.pool"))
    assert len(new) == 1 and new[0] != pool and not Path(part_path(str(pool), layout, 1)).exists()


def test_the_operators_command_counts_and_discards_every_file_of_a_kept_pool(start_daemon):
    daemon = start_daemon(pool_files=4)
    assert daemon.stop() == 0
    [pool] = daemon.folder.glob("*.pool")
    layout = kept_pools.read_header(str(pool))[0]["layout"]
    files = [Path(part_path(str(pool), layout, k)) for k in range(4)]
    held = sum(f.stat().st_blocks * 512 for f in files)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "kvdepot.client.cli", "pools", "--pool-dir",
                               str(daemon.folder), *args], capture_output=True, text=True, env=subprocess_env(),
                              timeout=60)

    listed = cli("--json")
    assert listed.returncode == 0, listed.stderr
    [shown] = [p for p in json.loads(listed.stdout) if p["path"] == str(pool)]
    assert shown["path"] == str(pool) and shown["bytes"] == held
    gone = cli("--discard", str(pool))
    assert gone.returncode == 0, gone.stderr
    assert not any(f.exists() for f in files)


def test_pool_files_out_of_range_is_refused_at_start(tmp_path):
    run = subprocess.run([sys.executable, "-m", "kvdepot.server", "--listen", str(tmp_path / "s.sock"),
                          "--pool-size", "4MiB", "--pin", "off", "--pool-dir", str(tmp_path), "--pool-files", "65"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert run.returncode != 0 and "pool_files must be 0 (automatic) to 64" in run.stderr


@needs_second_uid
def test_a_later_file_another_uid_put_in_place_is_not_adopted_nor_written(
        start_daemon, client_factory, shared_tmp):  # noqa: F811 (the fixture)
    """A pool folder others may write without the sticky bit (a misconfigured
    shared folder): another uid swaps one of a kept pool's later files for its
    own, with bytes of its choice. The daemon, root here, could open it; it
    must refuse it for its owner."""
    folder = shared_tmp
    folder.chmod(0o777)  # not sticky: names there can be replaced by anyone
    daemon = start_daemon(pool_files=4, pool_dir=str(folder))
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=15)
    keys = prompt_keys(8, prompt=16)
    store(client, worker, keys)
    assert daemon.stop() == 0
    [pool] = folder.glob("*.pool")
    second = part_path(str(pool), kept_pools.read_header(str(pool))[0]["layout"], 1)
    size = os.path.getsize(second)
    swap = (f"import os; os.unlink({second!r}); fd = os.open({second!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY, "
            f"0o600); os.ftruncate(fd, {size}); os.pwrite(fd, b'attacker' * 512, 0); os.close(fd)")
    subprocess.run([*as_uid(NOBODY), sys.executable, "-c", swap], check=True, timeout=30, cwd="/")
    assert os.stat(second).st_uid == NOBODY
    daemon.start()
    assert f"belongs to uid {NOBODY}" in daemon.log()
    assert client.wait_connected(15)
    assert client.lookup(engine, keys).ready_blocks == 0
    with open(second, "rb") as f:  # left as the other uid made it
        assert f.read(16) == b"attackerattacker"


def test_files_of_a_pool_whose_first_file_is_gone_are_removed_at_the_next_start(start_daemon, tmp_path):
    folder = tmp_path / "pools"
    folder.mkdir()
    # Left by a daemon cut short while it removed a pool, or by an older kvdepot that knew one file.
    kept = HostPool(size=4 << 20, slot_bytes=SLOT_BYTES, directory=str(folder), name="kvdepot-gone-x", pin="off",
                    files=4)
    kept.close()
    os.unlink(folder / "kvdepot-gone-x.pool")
    # Its namespace catalog, as an older kvdepot's failed start left it.
    (folder / "kvdepot-gone-x.namespaces.json").write_text("{}")
    # Not a pool's file: another program's name, and a file of this pool's name with no number.
    (folder / "kvdepot-gone-x.pool.notes").write_text("keep")
    (folder / "other.pool.1").write_text("keep")
    daemon = start_daemon(pool_dir=str(folder))
    assert "a file of a pool whose first file is gone" in daemon.log()
    assert not list(folder.glob("kvdepot-gone-x.pool.[0-9]*"))
    assert not (folder / "kvdepot-gone-x.namespaces.json").exists()
    assert len(list(folder.iterdir())) >= 4  # the daemon's own pool, its catalog, and the two left alone
    assert (folder / "kvdepot-gone-x.pool.notes").exists() and (folder / "other.pool.1").exists()


@needs_second_uid
def test_another_uid_at_the_first_files_name_does_not_keep_our_orphans(start_daemon, shared_tmp):  # noqa: F811
    """The first file's name is seen in a shared folder; another user who
    takes it once it is gone must not make the daemon keep the later files."""
    kept = HostPool(size=4 << 20, slot_bytes=SLOT_BYTES, directory=str(shared_tmp), name="kvdepot-gone-y",
                    pin="off", files=4)
    kept.close()
    os.unlink(shared_tmp / "kvdepot-gone-y.pool")
    first = str(shared_tmp / "kvdepot-gone-y.pool")
    plant = f"open({first!r}, 'w').write('not a pool')"
    subprocess.run([*as_uid(NOBODY), sys.executable, "-c", plant], check=True, timeout=30, cwd="/")
    daemon = start_daemon(pool_dir=str(shared_tmp))
    assert "a file of a pool whose first file is gone" in daemon.log()
    assert not list(shared_tmp.glob("kvdepot-gone-y.pool.[0-9]*"))
    assert os.stat(first).st_uid == NOBODY  # theirs, left alone
