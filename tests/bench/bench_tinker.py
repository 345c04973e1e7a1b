"""Tinker API benchmarks (docs/architecture.md §12): the API's overhead, and how sampling serves snapshots.

``tinker_api.overhead_ratio`` (goal <= 1.2): ``forward_backward`` + ``optim_step`` through the API over
the same work in process. The API side is the official SDK against a live ``tandem serve`` (its own
process, embedded Redis, every request recorded before it is answered, the result long-polled); the
in-process side is the very trainer code the service runs (``BaseHost`` + ``LoraClient``) on the same
batches. The arms take turns in rounds of ``STEPS_PER_ROUND`` steps, their order flipping every round,
so a busy machine slows both alike; the figure is the median of the per-round ratios (and half their
range as ``overhead_ratio_spread``). The CPU time a step costs (this process + the server + Redis) is
compared too (``cpu_overhead_ratio``).

``merged_over_lora_ratio``: one RL round (publish the trained adapter, then sample from it) with
merged snapshots, an engine per snapshot (what the service does), over LoRA served per request on one
base engine; the demo-sized model, arms alternated.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from services.common.embedded_redis import EmbeddedRedis
from services.demo.tiny_model import create_tiny_model

BATCH, LENGTH, STEPS_PER_ROUND, ROUNDS_FB = 8, 256, 3, 8


def _batch(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 250, (LENGTH,), generator=g).tolist() for _ in range(BATCH)]


def _in_process(model_dir: Path):  # type: ignore[no-untyped-def]
    from services.tinker_api.lora_host import BaseHost, LoraClient

    return _in_process_client(LoraClient(BaseHost(str(model_dir)), "bench", rank=8, seed=0, mlp=True, attn=True,
                                         unembed=True))


def _in_process_client(client):  # type: ignore[no-untyped-def]
    from services.tinker_api.lora_host import Datum

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


def _rounds(arms: dict[str, Any], procs: list[psutil.Process]) -> dict[str, list[float]]:
    """ROUNDS rounds of STEPS_PER_ROUND steps per arm; the arms' order flips every round (round 0 is warm-up)."""
    times: dict[str, list[float]] = {k: [] for name in arms for k in (name, f"{name}_cpu")}
    names = list(arms)
    for i in range(ROUNDS_FB + 1):
        for name in (names if i % 2 else names[::-1]):
            cpu0, start = _cpu(procs), time.perf_counter()
            for k in range(STEPS_PER_ROUND):
                arms[name](_batch(i * STEPS_PER_ROUND + k))
            if i:
                times[name].append((time.perf_counter() - start) / STEPS_PER_ROUND)
                times[f"{name}_cpu"].append((_cpu(procs) - cpu0) / STEPS_PER_ROUND)
    return times


def run() -> dict[str, float]:
    from tests.tinker_server import TinkerServer

    with tempfile.TemporaryDirectory(prefix="tandem-bench-tinker-") as tmp, EmbeddedRedis(appendonly=True) as redis:
        model_dir = create_tiny_model(Path(tmp) / "local" / "model", seed=0)
        server = TinkerServer(redis.url, Path(tmp) / "serve").start()
        try:
            api_step, service = _through_api(server.url, model_dir)
            procs = [psutil.Process(), psutil.Process(server.proc.pid), psutil.Process(redis.proc.pid)]  # type: ignore
            times = _rounds({"api": api_step, "local": _in_process(model_dir)}, procs)
            service.close("success").result()
        finally:
            server.stop()
        demo_dir = create_tiny_model(Path(tmp) / "demo" / "model", seed=0, hidden=64, layers=2)
        sampling = _sampling_arms(demo_dir, Path(tmp))
    med = {k: statistics.median(v) for k, v in times.items()}
    per_round = [a / b for a, b in zip(times["api"], times["local"], strict=True)]
    return {"overhead_ratio": round(statistics.median(per_round), 3),
            "overhead_ratio_spread": round((max(per_round) - min(per_round)) / 2, 3),
            "cpu_overhead_ratio": round(med["api_cpu"] / med["local_cpu"], 3),
            "api_step_s": round(med["api"], 4), "in_process_step_s": round(med["local"], 4),
            "api_overhead_ms_per_step": round(1000 * (med["api"] - med["local"]), 1),
            "batch_tokens": BATCH * (LENGTH - 1), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count() or 0,
            **sampling}


# -- sampling: merged snapshots (an engine per snapshot, loaded lazily) vs LoRA served per request ---------
G, PROMPT, NEW, ROUNDS = 8, 64, 32, 6


def _gens(engine, seed: int) -> list[tuple[list[int], list[float]]]:  # type: ignore[no-untyped-def]
    import asyncio

    from services.inference import GenRequest

    prompt = _batch(1000 + seed)[0][:PROMPT]
    reqs = [GenRequest(rid=f"b{seed}/{i}", input_ids=prompt, max_new_tokens=NEW, seed=seed * 100 + i,
                       ignore_eos=True) for i in range(G)]
    done = asyncio.run(engine.generate_many(reqs))
    return [(list(g.output_ids), list(g.logprobs)) for g in done]


def _sampling_arms(model_dir: Path, tmp: Path) -> dict[str, float]:
    """One RL round = publish the trainer's adapter as a snapshot, then sample G x NEW tokens from it.

    ``merged``: what the service does: fold the adapter into the base, write an HF directory,
    start an engine on it (a new snapshot is never in the LRU yet), sample, evict. ``lora``: one
    engine on the base whose linears carry an unmerged peft adapter: publishing writes the
    adapter's tensors only, and a request loads them into the engine's adapter before it samples.
    """
    from peft import LoraConfig, get_peft_model

    from services.inference import Engine
    from services.tinker_api.lora_host import LORA_ALPHA, BaseHost, LoraClient

    host = BaseHost(str(model_dir))
    client = LoraClient(host, "policy", rank=8, seed=0, mlp=True, attn=True, unembed=False)
    served = Engine(model_dir)
    cfg = LoraConfig(r=8, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=client.targets,
                     bias="none", task_type="CAUSAL_LM")
    served.model = get_peft_model(served.model, cfg, adapter_name="snap").eval()
    slots = {n: p for n, p in served.model.named_parameters() if "lora_" in n}
    train = _in_process_client(client)
    times: dict[str, list[float]] = {"merged": [], "lora": []}
    agree: list[float] = []
    for i in range(ROUNDS + 1):
        train(_batch(i))  # the weights move every round: every snapshot is new
        out: dict[str, list[tuple[list[int], list[float]]]] = {}
        for arm in (("merged", "lora") if i % 2 else ("lora", "merged")):
            start = time.perf_counter()
            if arm == "merged":
                engine = Engine(host.export(client.name, tmp / f"merged-{i}"))
                out[arm] = _gens(engine, i)
                engine.stop()
            else:
                path = tmp / f"adapter-{i}.pt"
                torch.save({k: v.detach().clone() for k, v in host.adapter_params(client.name).items()}, path)
                with torch.no_grad():
                    for k, v in torch.load(path).items():
                        slots[k.replace(f".{client.name}.", ".snap.")].copy_(v)
                out[arm] = _gens(served, i)
            if i:  # round 0 is warm-up
                times[arm].append(time.perf_counter() - start)
        for (ids_m, lp_m), (ids_l, lp_l) in zip(out["merged"], out["lora"], strict=True):
            same = next((k for k, (a, b) in enumerate(zip(ids_m, ids_l, strict=True)) if a != b), len(ids_m))
            agree += [abs(a - b) for a, b in zip(lp_m[:same + 1], lp_l[:same + 1], strict=False)]
    served.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"merged_over_lora_ratio": round(med["merged"] / med["lora"], 3), "merged_round_s": round(med["merged"], 4),
            "lora_round_s": round(med["lora"], 4), "sampling_max_logprob_diff": float(f"{max(agree):.2e}")}


def _cpu(procs: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
