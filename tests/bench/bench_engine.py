"""Engine benchmarks, side by side in one run on the demo model's architecture.

* ``ratio_vs_hf_generate``: tokens/s of the embedded engine (a real ``python -m services.engine``
  process, over HTTP) serving 32 concurrent requests × 64 new tokens, over tokens/s of naive
  per-request ``model.generate`` (one request after the other) on the same model and prompts.
* ``router_overhead_ratio``: wall time of the same load through the real sglang-router over wall
  time straight to the engine (1.0 = no overhead; best of two alternating runs each).
* ``weight_update_ms``: ``POST /update_weights_from_disk`` of the demo model, idle engine, median of 5.
* ``hf_generate_batch_tokens_per_s``: transformers' own continuous batching (``generate_batch``) on
  the same load, the alternative the engine's scheduler was measured against.

The model: ``models/demo-ttt`` when ``tandem init-demo`` made it, else a fresh model of the same
architecture and size (``services/demo``); speed does not depend on the weights' values.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from services.common.embedded_redis import free_port
from services.common.sglang_router import list_workers, router_command, wait_healthy
from services.demo.tiny_model import create_tiny_model
from services.demo.warmstart import DEFAULT_HIDDEN, DEFAULT_LAYERS

ROOT = Path(__file__).resolve().parents[2]
N_REQ, N_NEW = 32, 64


def _model_dir(tmp: Path) -> Path:
    demo = ROOT / "models" / "demo-ttt"
    if (demo / "config.json").is_file():
        return demo
    return create_tiny_model(tmp / "demo-arch", seed=0, hidden=DEFAULT_HIDDEN, layers=DEFAULT_LAYERS)


def _prompts() -> list[list[int]]:
    return [[5 + (i * 7 + j) % 200 for j in range(8 + i % 17)] for i in range(N_REQ)]


def naive_generate(model_dir: Path, prompts: list[list[int]]) -> float:
    torch.set_num_threads(1)  # as the engine
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = GenerationConfig(max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=True, temperature=1.0, top_k=0,
                           pad_token_id=model.config.pad_token_id, eos_token_id=model.config.eos_token_id)
    model.generate(torch.tensor([prompts[0]]), generation_config=cfg)  # warm-up
    start, tokens = time.perf_counter(), 0
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), generation_config=cfg)
            tokens += out.shape[1] - len(p)
    return tokens / (time.perf_counter() - start)


def hf_generate_batch(model_dir: Path, prompts: list[list[int]]) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = GenerationConfig(max_new_tokens=N_NEW, do_sample=True, temperature=1.0, top_k=0, eos_token_id=-1,
                           pad_token_id=model.config.pad_token_id)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=cfg, warmup=False)
    return sum(len(o.generated_tokens) for o in out.values()) / (time.perf_counter() - start)


async def _load(url: str, prompts: list[list[int]]) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=600) as http:
        async def one(i: int, p: list[int]) -> int:
            resp = await http.post(f"{url}/generate", json={
                "input_ids": p, "return_logprob": True, "sampling_params": {
                    "max_new_tokens": N_NEW, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i}})
            resp.raise_for_status()
            return len(resp.json()["output_ids"])
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        return time.perf_counter() - start, tokens


def _start(model_dir: Path, procs: list[subprocess.Popen[bytes]]) -> tuple[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    port, rport = free_port(), free_port()
    engine = f"http://127.0.0.1:{port}"
    procs.append(subprocess.Popen([sys.executable, "-m", "services.engine", "--model-path", str(model_dir),
                                   "--port", str(port), "--max-batch", "64"], env=env, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    procs.append(subprocess.Popen(router_command(rport, [engine]), env=env, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return engine, f"http://127.0.0.1:{rport}"


async def _served(model_dir: Path, prompts: list[list[int]], engine: str, router: str) -> dict[str, float]:
    await wait_healthy(engine, timeout=120)
    await wait_healthy(router, timeout=60)
    for _ in range(600):
        if await list_workers(router, healthy_only=True):
            break
        await asyncio.sleep(0.2)
    await _load(engine, prompts[:4])  # warm-up
    direct, routed = [], []
    for _ in range(2):
        direct.append(await _load(engine, prompts))
        routed.append(await _load(router, prompts))
    best_direct, best_routed = min(direct), min(routed)
    async with httpx.AsyncClient(timeout=120) as http:
        times = []
        for v in range(1, 6):
            start = time.perf_counter()
            resp = await http.post(f"{engine}/update_weights_from_disk",
                                   json={"model_path": str(model_dir), "weight_version": str(v)})
            times.append((time.perf_counter() - start) * 1000)
            assert resp.json()["success"], resp.text
    return {"engine_tokens_per_s": best_direct[1] / best_direct[0],
            "router_tokens_per_s": best_routed[1] / best_routed[0],
            "router_overhead_ratio": best_routed[0] / best_direct[0],
            "weight_update_ms": statistics.median(times)}


def run() -> dict[str, Any]:
    prompts = _prompts()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(Path(tmp))
        try:
            served = asyncio.run(_served(model_dir, prompts, *_start(model_dir, procs)))
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
        naive = naive_generate(model_dir, prompts)
        batch = hf_generate_batch(model_dir, prompts)
    return {"model": str(model_dir.name), "requests": N_REQ, "new_tokens": N_NEW,
            "hf_generate_tokens_per_s": round(naive, 1),
            "engine_tokens_per_s": round(served["engine_tokens_per_s"], 1),
            "ratio_vs_hf_generate": round(served["engine_tokens_per_s"] / naive, 2),
            "router_tokens_per_s": round(served["router_tokens_per_s"], 1),
            "router_overhead_ratio": round(served["router_overhead_ratio"], 3),
            "weight_update_ms": round(served["weight_update_ms"], 1),
            "hf_generate_batch_tokens_per_s": round(batch, 1)}
