"""torchrun entry point for the distributed tests: `dist_worker.py MODULE FUNCTION OUT`.

Joins the gloo process group, calls MODULE.FUNCTION() and saves its result to OUT.<rank>."""
import importlib
import os
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    module, function, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = getattr(importlib.import_module(module), function)()
    torch.save(result, f"{out}.{dist.get_rank()}")
    dist.destroy_process_group()
