"""`kill_at_step.py SCRIPT RANK CALL ARG...`: SCRIPT's main(ARGs) as its __main__ runs it, killed
with SIGKILL as rank RANK enters train_step for the CALL-th time (from 1); under torchrun too."""
import importlib
import os
import signal
import sys

import common

if __name__ == "__main__":
    script, rank, call, *argv = sys.argv[1:]
    module = importlib.import_module(script)
    real, calls = module.train_step, []

    def train_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(call) and common.rank() == int(rank):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    module.train_step = train_step
    common.run(lambda: module.main(argv))
