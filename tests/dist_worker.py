"""torchrun entry point for the distributed tests: `dist_worker.py MODULE FUNCTION OUT [ARG...]`.

Joins the gloo process group, calls MODULE.FUNCTION(*ARGs) and saves its result to OUT.<rank>."""
import importlib
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    module, function, out, *args = sys.argv[1:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = getattr(importlib.import_module(module), function)(*args)
    torch.save(result, f"{out}.{dist.get_rank()}")
    dist.destroy_process_group()
