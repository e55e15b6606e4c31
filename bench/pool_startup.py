"""How long kvdepotd takes to serve, and to have its whole pool up, against
torch's own pinned allocation of the same size measured in the same run.

    python bench/pool_startup.py --size 16GiB [--compare ../previous-checkout]

Starts the real daemon with a pool of SIZE and times, from its process start,
its "ready on" line (it serves) and the line saying the whole pool is up
(faulted in, and pinned with CUDA). A daemon that brings its whole pool up
before it serves (versions before the pool came up behind the start) has both
at once. With --compare, the daemon of that source tree is timed first, in the
same run. Without CUDA only faulting in is measured.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvdepot.settings import parse_size  # noqa: E402


def start_daemon(repo: Path, size: str, folder: str, threads: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    socket_dir = tempfile.mkdtemp()  # a hugetlbfs pool folder cannot hold a socket
    args = [sys.executable, "-m", "kvdepot.server", "--listen", f"{socket_dir}/kvdepot.sock",
            "--pool-size", size, "--pool-dir", folder, "--pin-threads", str(threads), "--metrics-listen", "none"]
    started = time.monotonic()
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env, cwd=repo)
    log, ready, up, behind = [], None, None, False
    for line in proc.stderr:
        log.append(line)
        if "coming up behind" in line:
            behind = True
        if "ready on" in line:
            ready = time.monotonic() - started
            if not behind:
                up = ready
        if "pool up: all" in line:
            up = time.monotonic() - started
        if ready is not None and up is not None:
            break
    proc.terminate()
    proc.wait(60)
    text = "".join(log)
    if ready is None or up is None:
        raise SystemExit("the daemon did not come up:\n" + text)
    return {"ready_s": ready, "up_s": up, "log": text}


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
    parser.add_argument("--compare", type=Path, help="another source tree whose daemon is timed first")
    parser.add_argument("--label", default="this", help="this tree's name in the table")
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    gib = nbytes / 2**30
    trees = ([("previous", args.compare.resolve())] if args.compare else []) + [(args.label, REPO)]
    rows = []
    for name, repo in trees:
        with tempfile.TemporaryDirectory(dir=args.folder) as folder:
            rows.append((name, start_daemon(repo, args.size, folder, args.threads)))
    print(f"pool of {gib:.1f} GiB in {args.folder}, seconds from the process start")
    print(f"{'version':<12} {'serving':>8} {'whole pool up':>14} {'GiB/s up':>9}")
    for name, row in rows:
        print(f"{name:<12} {row['ready_s']:>8.2f} {row['up_s']:>14.2f} {gib / row['up_s']:>9.2f}", flush=True)
    try:
        baseline = torch_pinned_baseline(nbytes)
    except RuntimeError as e:  # torch cannot pin that much here
        print(f"baseline: torch pin_memory of the same size failed: {str(e).splitlines()[0]}")
        return 0
    if baseline is not None:
        print(f"baseline: torch pin_memory of the same size {baseline:.2f} s ({gib / baseline:.2f} GiB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
