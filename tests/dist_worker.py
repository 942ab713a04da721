"""torchrun entry point for the distributed tests: `dist_worker.py MODULE FUNCTION OUT [ARG...]`.

Imports MODULE, joins the gloo process group (DIST_BACKEND=nccl: NCCL's, a GPU per process, as
tests/test_cuda.py asks), calls MODULE.FUNCTION(*ARGs) and saves its result to OUT.<rank>."""
import importlib
import os
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    module, function, out, *args = sys.argv[1:]
    # Import before the process group exists: importing torch._dynamo (torchvision does) after
    # init_process_group leaves a reference to the group that destroy_process_group cannot drop,
    # so gloo's threads outlive it and can abort the interpreter's exit (see common.py's imports).
    module = importlib.import_module(module)
    backend = os.environ.get("DIST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    result = getattr(module, function)(*args)
    torch.save(result, f"{out}.{dist.get_rank()}")
    dist.destroy_process_group()
