"""Hold all but N GiB of one GPU until killed, so that a study's memory budget is physical:
a configuration the memory model wrongly admits then fails with a real out-of-memory.

    CUDA_VISIBLE_DEVICES=1 setsid python3 bench/hold_gpu_memory.py --leave-gib 12 &
"""

import argparse
import signal
import time

import torch

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--leave-gib", type=float, required=True, help="memory to leave free, GiB")
args = ap.parse_args()
torch.cuda.init()
free, total = torch.cuda.mem_get_info()
take = free - int(args.leave_gib * 2**30)
if take <= 0:
    raise SystemExit(f"only {free / 2**30:.1f} GiB free: nothing to hold")
held = torch.empty(take, dtype=torch.uint8, device="cuda")
free_after, _ = torch.cuda.mem_get_info()
print(f"holding {take / 2**30:.2f} GiB of {total / 2**30:.2f}; {free_after / 2**30:.2f} GiB free", flush=True)


def leave(*_):
    raise SystemExit(0)


signal.signal(signal.SIGTERM, leave)
while True:
    time.sleep(3600)
