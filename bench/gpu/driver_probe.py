"""Which of a warm process's imports map the CUDA driver (libcuda.so), and which initialise it
(cuInit), on this machine: a fork is unusable for CUDA only after the second.

    python3 bench/gpu/driver_probe.py [--target cuda]     prints one JSON line per module

With --who, torch's entry points that may initialise the driver are wrapped once torch is
imported, and the Python stack of the first call that left the driver initialised is printed:
the line of the import that makes a warm process serve calls from spares rather than forks (on the H100, torch 2.11.0+cu130:
within torch._inductor.compile_fx).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback

from cudabuild.engine.warm_server import device_driver_state as driver_state
from cudabuild.pipeline import PIPELINE


def watch_initialisers() -> None:
    """Wrap what can call cuInit; print the stack of the first call after which it was called."""
    import torch

    def wrapped(owner, name):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            before = driver_state()
            try:
                return original(*args, **kwargs)
            finally:
                if before != "initialised" and driver_state() == "initialised":
                    print(json.dumps({"initialised_by": f"{owner.__name__}.{name}",
                                      "stack": traceback.format_stack()[-12:-1]}), flush=True)
        setattr(owner, name, call)

    for owner, name in ((torch.cuda, "is_available"), (torch.cuda, "device_count"), (torch.cuda, "_lazy_init"),
                        (torch.cuda, "get_device_capability"), (torch.cuda, "get_device_properties"),
                        (torch._C, "_cuda_getDeviceCount")):
        if hasattr(owner, name):
            wrapped(owner, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--who", action="store_true")
    args = parser.parse_args()
    modules = PIPELINE.warm_imports(args.target)
    for name in modules:
        started = time.monotonic()
        importlib.import_module(name)
        if args.who and name == "torch":
            watch_initialisers()
        print(json.dumps({"module": name, "seconds": round(time.monotonic() - started, 2), "driver": driver_state()}),
              flush=True)


if __name__ == "__main__":
    main()
