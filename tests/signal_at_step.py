"""`signal_at_step.py SCRIPT RANK CALL SIGNAL ARG...`: SCRIPT's main(ARGs) as its __main__ runs it
(common.run), which sends SIGNAL (TERM, INT, KILL) to its own process when rank RANK enters
train_step for the CALL-th time (from 1), as a scheduler or a lost node would; under torchrun too.
SIGNAL TERM-JOB sends SIGTERM to every process of the job at once, as Slurm ends a job step: the
launcher (this process, or torchrun), every rank and every DataLoader worker.
The run's command line is the ARGs: run again as `SCRIPT.py ARG...`, it is the same command.

SIGINT is handled as in a terminal's foreground process (KeyboardInterrupt), however the suite was
started: a background job of a non-interactive shell inherits SIGINT ignored, and Python keeps an
inherited ignore."""
import importlib
import os
import signal
import sys

import common

def job():
    """The launcher's pid (torchrun's under torchrun) and its descendants'."""
    root = os.getppid() if int(os.environ.get("WORLD_SIZE", 1)) > 1 else os.getpid()
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:  # ended meanwhile
            pass
    family = {root}
    while True:
        more = {p for p, parent in parents.items() if parent in family} - family
        if not more:
            return family
        family |= more


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    script, rank, call, name, *argv = sys.argv[1:]
    module = importlib.import_module(script)
    real, calls = module.train_step, []

    def train_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(call) and common.rank() == int(rank):
            if name == "TERM-JOB":
                for pid in sorted(job(), key=lambda pid: pid == os.getpid()):
                    os.kill(pid, signal.SIGTERM)  # this process last: its handler raises
            else:
                os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
        return real(*args, **kwargs)

    module.train_step = train_step
    common.run(lambda: module.main(argv))
