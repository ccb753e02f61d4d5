"""Host cost of reading and setting the current device (per call, microseconds), and of a decode
step's host work (begin, write_newest per layer, end; tiny preset, batch 8) with and without the
current-device check of `begin_decode_step`. Decides how the engine keeps to its device
(docs/reliability.md, "Threads").

    PYTHONPATH=src python benchmarks/device_overhead.py > device-overhead.json

(`benchmarks/results/device-overhead-h200.json` holds two such runs, one of an earlier version
of this script that also switched devices per call, gathered into one file by hand.)
"""
import argparse
import importlib.metadata
import json
import sys
import time

import torch

import hisparse

argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help
if not torch.cuda.is_available():
    print("device_overhead.py: needs a CUDA GPU; none is visible", file=sys.stderr)
    sys.exit(2)
dev = torch.device("cuda", torch.cuda.current_device())
n = 50_000


def per_call(fn) -> float:
    for _ in range(1000):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - start) / n * 1e6, 3)


def scope() -> None:
    with torch.cuda.device(dev):
        pass


results = {
    "torch.cuda.current_device": per_call(torch.cuda.current_device),
    "torch._C._cuda_getDevice": per_call(torch._C._cuda_getDevice),
    "torch.accelerator.current_device_index": per_call(torch.accelerator.current_device_index),
    "torch.cuda._exchange_device(same)": per_call(lambda: torch.cuda._exchange_device(dev.index)),
    "with torch.cuda.device": per_call(scope),
}
config = hisparse.HiSparseConfig.from_preset("tiny", max_requests=8, max_batch=8)
cache = hisparse.HiSparseCache(config, device="cuda")
ids = []
for i in range(8):
    cache.admit(i, 40)
    cache.write_prefill(i, torch.zeros(cache.num_layers, 40, cache.row_bytes, dtype=torch.uint8))
    cache.commit_prefill(i)
    ids.append(i)


def step_time(steps: int = 300) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        cache.begin_decode_step(ids)
        for layer in range(cache.num_layers):
            cache.write_newest(layer, torch.zeros(8, cache.row_bytes, dtype=torch.uint8,
                                                  device=cache.device))
        cache.end_decode_step()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        if cache.seq_len(0) >= config.max_seq_len - 1:
            break
    times.sort()
    return round(times[len(times) // 2] * 1e6, 2)


results["step_with_device_check_us"] = step_time(100)
backend = cache.backend
backend.current_device = lambda: None
results["step_without_device_check_us"] = step_time(100)
del backend.current_device
results["step_with_device_check_again_us"] = step_time(100)
results["card"] = torch.cuda.get_device_name()
results["triton"] = importlib.metadata.version("triton")
results["command"] = "PYTHONPATH=src python benchmarks/device_overhead.py"
results["torch"] = torch.__version__
results["python"] = sys.version.split()[0]
print(json.dumps(results))
