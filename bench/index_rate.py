"""The native index's cost a block: checks and slot reservation without the wire or the copy.

    python bench/index_rate.py [--jobs 4000] [--source DIR ...]

Compiles bench/index_rate.cpp against the native lane's index (server/native/src, or the
same folder of each --source tree: a checkout of another version, to compare in one run)
and runs it for a pool of 64 GiB in 64 KiB slots filled with blocks of 2 MiB and of 256 KiB.
Each job stores 64 new keys and commits them, evicting the oldest blocks once the pool is
full, then loads the same keys. It prints the median over three runs of the ns a block each
takes, and how many blocks the pool held. Needs a C++ compiler (g++, clang++ or $CXX).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvdepot.server.native import build  # noqa: E402

SLOTS = 1 << 20  # 64 GiB of 64 KiB slots
SPANS = {"2 MiB": 32, "256 KiB": 4}
LINK_ONLY = {"-shared", "-fPIC", "-fvisibility=hidden", "-Wl,--no-undefined"}


def compile_bench(source: Path, out: Path) -> Path:
    src = source / "server" / "native" / "src"
    units = [src / f"{name}.cpp" for name in ("index", "index_host", "eviction", "slots")]
    cxx = build.compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler (g++, clang++ or $CXX) on the PATH")
    flags = [f for f in build.FLAGS if f not in LINK_ONLY]
    binary = out / f"index_rate-{len(list(out.iterdir()))}"
    command = [cxx, *flags, f"-I{src}", str(REPO / "bench" / "index_rate.cpp"), *map(str, units), "-o", str(binary)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compiling against {source} failed:\n{done.stderr[-3000:]}")
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4000, help="jobs of 64 blocks a run")
    parser.add_argument("--source", type=Path, action="append", help="a source tree (default: this one)")
    args = parser.parse_args()
    sources = args.source or [REPO]
    with tempfile.TemporaryDirectory() as tmp:
        binaries = [(source, compile_bench(source, Path(tmp))) for source in sources]
        print(f"{'tree':<32} {'block':>8} {'store ns':>9} {'load ns':>8} {'held':>8}")
        for label, span in SPANS.items():
            for source, binary in binaries:
                runs = []
                for _ in range(3):
                    out = subprocess.run([str(binary), str(SLOTS), str(span), str(args.jobs)], check=True,
                                         capture_output=True, text=True).stdout.split()
                    runs.append(tuple(int(x) for x in out))
                store = statistics.median(r[0] for r in runs)
                load = statistics.median(r[1] for r in runs)
                print(f"{str(source)[-32:]:<32} {label:>8} {store:>9.0f} {load:>8.0f} {runs[0][2]:>8}")


if __name__ == "__main__":
    main()
