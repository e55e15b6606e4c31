"""How long kvdepotd takes to allocate and pin its pool, against torch's own
pinned allocation of the same size measured in the same run.

    python bench/pool_startup.py --size 16GiB

Prints the daemon's allocate and pin times (from its log), its time to ready,
and the ratio to `torch.empty(size, pin_memory=True)`. Without CUDA only the
allocation is measured.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvdepot.settings import parse_size  # noqa: E402


def start_daemon(size: str, folder: str, threads: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    socket_dir = tempfile.mkdtemp()  # a hugetlbfs pool folder cannot hold a socket
    args = [sys.executable, "-m", "kvdepot.server", "--listen", f"{socket_dir}/kvdepot.sock",
            "--pool-size", size, "--pool-dir", folder, "--pin-threads", str(threads)]
    started = time.monotonic()
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    log = []
    for line in proc.stderr:
        log.append(line)
        if "ready on" in line:
            break
    ready = time.monotonic() - started
    proc.terminate()
    proc.wait(60)
    text = "".join(log)
    allocated = re.search(r"allocated in ([0-9.]+) s", text)
    pinned = re.search(r"pool pinned in ([0-9.]+) s", text)
    if not allocated:
        raise SystemExit("the daemon did not start:\n" + text)
    return {
        "allocate_s": float(allocated.group(1)),
        "pin_s": float(pinned.group(1)) if pinned else None,
        "ready_s": ready,
    }


def torch_pinned_baseline(nbytes: int) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    start = time.monotonic()
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = time.monotonic() - start
    del buffer
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4GiB")
    parser.add_argument("--threads", type=int, default=0, help="--pin-threads of the daemon (0: automatic)")
    parser.add_argument("--folder", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    gib = nbytes / 2**30
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        daemon = start_daemon(args.size, folder, args.threads)
    baseline = torch_pinned_baseline(nbytes)
    print(f"pool size                      {gib:.1f} GiB")
    print(f"daemon: allocate (populate)    {daemon['allocate_s']:.2f} s  ({daemon['allocate_s'] / gib:.3f} s/GiB)")
    if daemon["pin_s"] is not None:
        print(f"daemon: pin (cudaHostRegister) {daemon['pin_s']:.2f} s  ({daemon['pin_s'] / gib:.3f} s/GiB)")
    print(f"daemon: start to ready         {daemon['ready_s']:.2f} s")
    if baseline is not None and daemon["pin_s"] is not None:
        total = daemon["allocate_s"] + daemon["pin_s"]
        print(f"baseline: torch pin_memory     {baseline:.2f} s  ({baseline / gib:.3f} s/GiB)")
        print(f"ratio daemon allocate+pin / baseline: {total / baseline:.2f} (lower is better)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
