"""Adapter sync against merged sync, and one engine serving two agents' adapters against two engines.

Per model (SmolLM2-135M-Instruct at ``BENCH_REAL_MODEL`` / ``/work/models/smollm2-135m-instruct`` when it is
there, and the tiny demo model), with a LoRA policy (r 8, alpha 16 on q/k/v/o; its B matrices drawn at random
so the adapter is not the identity) and a real ``python -m services.engine`` process over HTTP:

* ``adapter_sync_ms``: from the trainer's export of a version (``TorchPolicy.save``: the adapter directory and
  its checksum, what the trainer commits) to the engine serving it: the rollout's checksum of the files on disk
  (``weights_auth.refusal`` recomputes it), ``/load_lora_adapter``, and a one-token ``/generate`` naming it.
* ``merged_sync_ms``: the same for the merged export the trainer wrote before (the adapter folded into a copy
  of the model, ``save_pretrained`` with the tokenizer, the checksum), ``/update_weights_from_disk`` and a
  one-token ``/generate``. The two arms alternate for ``ROUNDS`` rounds (which goes first flips); medians.
* ``adapter_sync_bytes_ratio``: the adapter directory's bytes over the merged directory's.
* ``memory.shared_base_rss_ratio``: the resident memory (VmRSS) of one engine started on the base that loaded
  two agents' adapters and generated under each, over the sum of two engines started on the base that each
  loaded one agent's merged version (``/update_weights_from_disk``) and generated: one engine per agent.
* ``memory.mixed_batch_time_ratio``: on the shared engine, one batch ``/generate`` of ``MIX_ROWS`` prompts
  (``MIX_NEW`` tokens each) whose rows alternate the two adapters, over the same batch under one adapter;
  ``adapter_batch_time_ratio``: the batch under one adapter over the bare base (alternated rounds, medians).

Run alone: ``python -m tests.bench.bench_adapter_sync`` (prints the figures as JSON).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from services.common.admin_token import ADMIN_TOKEN_ENV
from services.common.embedded_redis import free_port
from services.common.weights_auth import weights_checksum
from services.contracts.config import AgentConfig, LoraConfig
from services.demo.tiny_model import create_tiny_model
from services.training.torch_backend import TorchPolicy, replace_dir

ROOT = Path(__file__).resolve().parents[2]
REAL_MODEL = Path(os.environ.get("BENCH_REAL_MODEL", "/work/models/smollm2-135m-instruct"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
TOKEN = "bench-admin-token"
LORA = LoraConfig(r=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
MIX_ROWS, MIX_NEW = 16, 16


class EngineProc:
    """One embedded engine process on ``model`` (its admin token set), stopped by ``close``."""

    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), ADMIN_TOKEN_ENV: TOKEN, "HF_HUB_OFFLINE": "1"}
        self.log = log.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.engine", "--model-path", str(model),
                                      "--port", str(self.port)], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, headers=HEADERS, timeout=600.0)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}; see {log}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"engine on {model} not healthy")

    def post(self, route: str, body: dict[str, Any]) -> Any:
        resp = self.http.post(route, json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"{route}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    def batch_s(self, loras: list[str | None]) -> float:
        """Seconds for one batch ``/generate`` with one prompt per entry of ``loras``."""
        body = {"input_ids": [[1 + i, 2, 3, 4] for i in range(len(loras))], "lora_path": loras,
                "sampling_params": {"max_new_tokens": MIX_NEW, "ignore_eos": True}}
        t0 = time.perf_counter()
        self.post("/generate", body)
        return time.perf_counter() - t0

    def one_token(self, lora: str | None = None) -> None:
        self.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1},
                                **({"lora_path": lora} if lora else {})})

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def lora_policy(model: Path, seed: int) -> TorchPolicy:
    policy = TorchPolicy(AgentConfig(model_path=str(model), lora=LORA, seed=seed), 1.0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return policy


def merged_export(policy: TorchPolicy, out: Path) -> tuple[Path, str]:
    """The trainer's export under LoRA before adapter sync: the merged model and its tokenizer, atomically."""
    tmp = out.with_name(out.name + ".tmp")
    copy.deepcopy(policy.model).merge_and_unload().save_pretrained(tmp, safe_serialization=True)  # adapters folded in
    policy.tokenizer.save_pretrained(tmp)
    replace_dir(tmp, out)
    return out, weights_checksum(out)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def sync_arms(model: Path, work: Path) -> dict[str, float]:
    policy = lora_policy(model, seed=1)
    engine = EngineProc(model, work / "engine.log")
    adapter_ms, merged_ms, sizes = [], [], {}
    try:
        engine.one_token()
        for rnd in range(ROUNDS):
            arms = ["adapter", "merged"] if rnd % 2 == 0 else ["merged", "adapter"]
            for arm in arms:
                out = work / f"{arm}-v{rnd + 1:05d}"
                t0 = time.perf_counter()
                if arm == "adapter":
                    path, checksum = policy.save(out)
                    assert weights_checksum(path) == checksum  # the rollout's check of the files on disk
                    engine.post("/load_lora_adapter", {"lora_name": f"A-v{rnd + 1}", "lora_path": str(path)})
                    engine.one_token(f"A-v{rnd + 1}")
                    adapter_ms.append((time.perf_counter() - t0) * 1000)
                    engine.post("/unload_lora_adapter", {"lora_name": f"A-v{rnd + 1}"})
                else:
                    path, checksum = merged_export(policy, out)
                    assert weights_checksum(path) == checksum
                    engine.post("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(rnd + 1)})
                    engine.one_token()
                    merged_ms.append((time.perf_counter() - t0) * 1000)
                sizes[arm] = dir_bytes(path)
                shutil.rmtree(path)
    finally:
        engine.close()
    return {"adapter_sync_bytes_ratio": round(sizes["adapter"] / sizes["merged"], 5),
            "adapter_bytes": sizes["adapter"], "merged_bytes": sizes["merged"],
            "adapter_sync_ms": round(statistics.median(adapter_ms), 1),
            "merged_sync_ms": round(statistics.median(merged_ms), 1),
            "merged_over_adapter_sync_time": round(statistics.median(merged_ms) / statistics.median(adapter_ms), 2)}


def shared_base_rss(model: Path, work: Path) -> dict[str, float]:
    agents = {a: lora_policy(model, seed=i + 1) for i, a in enumerate("AB")}
    adapters = {a: p.save(work / f"rss-{a}-adapter")[0] for a, p in agents.items()}
    merged = {a: merged_export(p, work / f"rss-{a}-merged")[0] for a, p in agents.items()}
    del agents
    shared = EngineProc(model, work / "shared.log")
    try:
        for a, path in adapters.items():
            shared.post("/load_lora_adapter", {"lora_name": a, "lora_path": str(path)})
            shared.one_token(a)
        shared_mb = shared.rss_mb()
        mixing = mixed_batches(shared)
    finally:
        shared.close()
    per_agent_mb = []
    for a, path in merged.items():
        engine = EngineProc(model, work / f"{a}.log")
        try:
            engine.post("/update_weights_from_disk", {"model_path": str(path), "weight_version": "1"})
            engine.one_token()
            per_agent_mb.append(engine.rss_mb())
        finally:
            engine.close()
    return {**mixing, "shared_base_rss_ratio": round(shared_mb / sum(per_agent_mb), 3),
            "shared_engine_rss_mb": round(shared_mb, 1), "per_agent_engines_rss_mb": round(sum(per_agent_mb), 1)}


def mixed_batches(engine: EngineProc) -> dict[str, float]:
    """Rows alternating two adapters in one batch against one adapter, and one adapter against the base."""
    arms: dict[str, list[str | None]] = {"mixed": ["A", "B"] * (MIX_ROWS // 2), "one": ["A"] * MIX_ROWS,
                                         "base": [None] * MIX_ROWS}
    times: dict[str, list[float]] = {k: [] for k in arms}
    engine.batch_s(arms["mixed"])  # untimed: the first batch of this size
    for rnd in range(ROUNDS):
        for name in (list(arms) if rnd % 2 == 0 else list(reversed(arms))):
            times[name].append(engine.batch_s(arms[name]))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"mixed_batch_time_ratio": round(med["mixed"] / med["one"], 3),
            "adapter_batch_time_ratio": round(med["one"] / med["base"], 3)}


def measure(model: Path) -> tuple[dict[str, float], dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="bench-adapter-") as tmp:
        work = Path(tmp)
        return sync_arms(model, work), shared_base_rss(model, work)


def run() -> dict[str, Any]:
    """``weights`` and ``memory`` sections: the real model's figures at the top when it is there (``model``
    says which), the tiny model's under ``tiny``."""
    with tempfile.TemporaryDirectory(prefix="bench-tiny-") as tmp:
        tiny = create_tiny_model(Path(tmp) / "model", seed=0)
        weights, memory = measure(tiny)
    weights, memory = {"model": "tiny", **weights}, {"model": "tiny", **memory}
    if (REAL_MODEL / "config.json").is_file():
        real_w, real_m = measure(REAL_MODEL)
        weights = {"model": REAL_MODEL.name, **real_w, "tiny": weights}
        memory = {"model": REAL_MODEL.name, **real_m, "tiny": memory}
    return {"weights": weights, "memory": memory}


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
