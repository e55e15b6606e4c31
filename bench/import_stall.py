"""How long the daemon's event loop waits while the CUDA transport's module is
imported on a thread once the daemon serves (daemon/main.py
add_cuda_transport), with the libraries server/daemon/preload.py loads
first without Python's lock (Triton's: "preload") and without ("import
only").

    python bench/import_stall.py [--rounds 3] [--drop-caches] [--module triton.language]

Each import runs in a fresh interpreter: a uvloop event loop, as the daemon's,
wakes every millisecond while its default executor imports
kvdepot.server.transports.cuda (torch alone where Triton is missing, as on a
machine without a GPU). Prints, per mode and round, the import's seconds and
the loop's longest waits: a call to the daemon waits as long. --drop-caches
(root) empties the page cache before each import, as after a reboot or an
upgrade of torch.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("import only", "preload")


async def measure(preload: bool, module: str) -> dict:
    from kvdepot.server.daemon import preload as libraries


    def imported() -> float:
        started = time.monotonic()
        if preload:
            libraries.load_all()
        importlib.import_module(module)
        return time.monotonic() - started

    loop = asyncio.get_running_loop()
    task = loop.run_in_executor(None, imported)
    waits, last = [], time.monotonic()
    while not task.done():
        await asyncio.sleep(0.001)
        now = time.monotonic()
        waits.append(now - last)
        last = now
    waits.sort()
    return {"module": module, "import_s": await task, "longest_ms": [round(w * 1000, 1) for w in waits[-3:]],
            "wakes": len(waits)}


def child(mode: str, module: str) -> None:
    import uvloop

    print(json.dumps(uvloop.run(measure(mode == "preload", module))), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drop-caches", action="store_true", help="empty the page cache before each import (root)")
    parser.add_argument("--module", help="what to import (default: the CUDA transport's module where Triton is "
                        "installed, else torch)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    module = args.module or ("kvdepot.server.transports.cuda" if importlib.util.find_spec("triton") else "torch")
    if args.child:
        child(args.child, module)
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    rows = []
    for round_ in range(args.rounds):
        for mode in MODES:  # in turns: the page cache warms between rounds alike
            if args.drop_caches:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            done = subprocess.run([sys.executable, __file__, "--child", mode, "--module", module], env=env,
                                  capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"the {mode} import failed:\n{done.stderr}")
            rows.append((round_ + 1, mode, json.loads(done.stdout.splitlines()[-1])))
    cache = "page cache emptied before each" if args.drop_caches else "page cache as it was"
    print(f"importing {rows[0][2]['module']} on a thread beside a loop waking every 1 ms ({cache})")
    print(f"{'round':>5}  {'mode':<12} {'import s':>8}  loop's longest waits (ms)")
    for round_, mode, row in rows:
        print(f"{round_:>5}  {mode:<12} {row['import_s']:>8.2f}  {', '.join(map(str, reversed(row['longest_ms'])))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
