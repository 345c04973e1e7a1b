"""Tinker API overhead: one ``forward_backward`` + ``optim_step`` through the API over the same work in process.

Side by side in one run: the API side is the official SDK against a live ``tandem serve``
(its own process, embedded Redis, every request recorded before it is answered, the
result long-polled); the in-process side is the very trainer code the service runs
(``BaseHost`` + ``LoraClient``) called directly on the same batch. Their steps alternate,
so a busy machine slows both alike; the figure is the ratio of the median step times
(``tinker_api.overhead_ratio``, goal <= 1.2). On a shared, busy machine wall time is noisy, so the CPU
time the step costs (this process + the server + Redis, user + system) is compared too
(``cpu_overhead_ratio``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from services.common.embedded_redis import EmbeddedRedis
from services.demo.tiny_model import create_tiny_model

BATCH, LENGTH, STEPS = 8, 128, 12


def _batch(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 250, (LENGTH,), generator=g).tolist() for _ in range(BATCH)]


def _in_process(model_dir: Path):  # type: ignore[no-untyped-def]
    from services.tinker_api.lora_host import BaseHost, Datum, LoraClient

    client = LoraClient(BaseHost(str(model_dir)), "bench", rank=8, seed=0, mlp=True, attn=True, unembed=True)
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 1.0}

    def step(rows: list[list[int]]) -> None:
        data = [Datum(tokens=r[:-1], inputs={"target_tokens": torch.tensor(r[1:]),
                                             "weights": torch.ones(len(r) - 1)}) for r in rows]
        client.forward_backward(data, "cross_entropy", {}, backward=True)
        client.optim_step(adam)
    return step


def _through_api(url: str, model_dir: Path):  # type: ignore[no-untyped-def]
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    tc = service.create_lora_training_client(base_model=str(model_dir), rank=8, seed=0).result()

    def step(rows: list[list[int]]) -> None:
        data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)}) for r in rows]
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4, grad_clip_norm=1.0))
        fb.result()
        opt.result()
    return step, service


def run() -> dict[str, float]:
    from tests.tinker_server import TinkerServer

    with tempfile.TemporaryDirectory(prefix="tandem-bench-tinker-") as tmp, EmbeddedRedis(appendonly=True) as redis:
        model_dir = create_tiny_model(Path(tmp) / "local" / "model", seed=0)
        server = TinkerServer(redis.url, Path(tmp) / "serve").start()
        try:
            api_step, service = _through_api(server.url, model_dir)
            local_step = _in_process(model_dir)
            procs = [psutil.Process(), psutil.Process(server.proc.pid), psutil.Process(redis.proc.pid)]  # type: ignore
            times: dict[str, list[float]] = {"api": [], "local": [], "api_cpu": [], "local_cpu": []}
            for i in range(STEPS + 1):
                for name, fn in (("api", api_step), ("local", local_step)):
                    rows = _batch(i)
                    cpu0, start = _cpu(procs), time.perf_counter()
                    fn(rows)
                    if i:  # the first step of each is warm-up
                        times[name].append(time.perf_counter() - start)
                        times[f"{name}_cpu"].append(_cpu(procs) - cpu0)
            service.close("success").result()
        finally:
            server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"overhead_ratio": round(med["api"] / med["local"], 3),
            "cpu_overhead_ratio": round(med["api_cpu"] / med["local_cpu"], 3),
            "api_step_s": round(med["api"], 4), "in_process_step_s": round(med["local"], 4),
            "batch_tokens": BATCH * (LENGTH - 1), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count() or 0}


def _cpu(procs: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
