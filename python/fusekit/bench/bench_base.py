"""What the Python benchmark drivers (`fusekit.bench.lm`, `fusekit.bench.decode`) share: the
device, the environment record, logging, the JSON result written atomically after every step,
synchronising and freeing memory between runs."""
from __future__ import annotations

import gc
import json
import os
import platform
import time

import torch

import fusekit

from .lm_runs import versions


class BenchBase:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.t0 = time.time()
        self.doc: dict = {}

    def environment(self) -> dict:
        env = {"device": str(self.device), "python": platform.python_version(), "versions": versions(),
               "fusekit": fusekit.build_info(), "torch_cuda": torch.version.cuda}
        if self.cuda:
            p = torch.cuda.get_device_properties(self.device)
            env |= {"gpu": p.name, "gpu_memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}"}
        return env

    @staticmethod
    def log(msg: str) -> None:
        print(msg, flush=True)

    def write(self) -> None:
        """self.doc to --out (when given), replacing the file whole: a run cut short leaves the
        results so far."""
        self.doc["seconds"] = round(time.time() - self.t0, 1)
        if not self.args.out:
            return
        tmp = self.args.out + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1)
        os.replace(tmp, self.args.out)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
