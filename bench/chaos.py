"""Chaos, long: tests/chaos.py's rounds of SIGKILL to clients and the daemon,
as many as asked, then its end-state checks; prints a summary (JSON).

  python bench/chaos.py --rounds 200 --clients 4 --seed 1

Exits 1 if any check failed (the summary's problems say which). The test
suite runs the same code for a few rounds (tests/test_chaos.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from chaos import run_chaos  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the folder of logs and client statuses")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="kvdepot-chaos-"))
    started = time.monotonic()
    summary = run_chaos(folder, rounds=args.rounds, clients=args.clients, seed=args.seed,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    summary["seconds"] = round(time.monotonic() - started, 1)
    if args.keep or summary["problems"]:
        summary["folder"] = str(folder)
    else:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(summary, indent=1))
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
