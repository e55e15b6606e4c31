"""A client process of its own, as a vLLM worker would be: run by the tests.

  store: make a random KV cache, store blocks, save the cache to --out
  load:  make a different KV cache, save it to --before, look up and load
         blocks into other block ids, save the result to --out
  hang-store / hang-load: submit a job, say so on stdout, and never wait for
         it (the test holds its copy in the daemon, and kills the process)
Prints one JSON line with what happened.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcache import make_kv_cache, namespace, prompt_keys  # noqa: E402

from kvdepot.client import KVDepotClient  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["store", "load", "hang-store", "hang-load"])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--layout", default="per_layer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--first-block", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (shared-memory transport), cuda or cuda:N")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--spin", action="store_true", help="hang-*: a long kernel runs before the job")
    parser.add_argument("--out")
    parser.add_argument("--before")
    args = parser.parse_args()

    if args.device.startswith("cuda:"):
        torch.cuda.set_device(args.device)  # as each vLLM worker process does
    client = KVDepotClient(args.socket, name=f"worker-{args.command}").connect(10)
    ns = namespace(args.layout, tp_size=args.tp)
    tensors, block_dim = make_kv_cache(args.layout, args.seed)
    tensors = [t.to(args.device) for t in tensors]
    worker = client.register_worker(ns, rank=args.rank, tensors=tensors, block_dim=block_dim)
    engine = client.register_engine(ns)
    keys = prompt_keys(args.blocks, args.prompt)
    block_ids = list(range(args.first_block, args.first_block + args.blocks))
    report: dict = {"pid": __import__("os").getpid()}

    if args.command in ("hang-store", "hang-load"):
        submit = client.submit_store if args.command == "hang-store" else client.submit_load
        if args.spin:
            torch.cuda._sleep(200_000_000_000)  # the data is written only after a long time
        submit(worker, 1, keys, block_ids)
        report["submitted"] = len(keys)
        print(json.dumps(report), flush=True)
        while True:
            time.sleep(60)

    if args.command == "store":
        client.submit_store(worker, 1, keys, block_ids)
    else:
        torch.save([t.cpu() for t in tensors], args.before)
        lookup = client.lookup(engine, keys)
        report["ready"] = lookup.ready_blocks
        client.submit_load(worker, 1, keys[: lookup.ready_blocks], block_ids[: lookup.ready_blocks])
    result = client.wait([1], timeout=30)[1]
    report.update(ok=result.ok, error=result.error)
    if args.out:
        torch.save([t.cpu() for t in tensors], args.out)
    client.close()
    print(json.dumps(report), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
