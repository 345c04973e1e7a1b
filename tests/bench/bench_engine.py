"""Engine benchmarks: the embedded engine over HTTP against a batched ``model.generate``, side by side.

The headline (``ratio_vs_batched_generate``, per concurrency): at each concurrency ``c`` in
``CONCURRENCY`` the bench sends ``c`` requests at once (each ``N_NEW`` new tokens, ``ignore_eos``,
temperature 1, its own seed, logprobs on, as the rollout asks) to a real ``python -m services.engine``
process over HTTP, and runs one batched ``model.generate`` on the same ``c`` prompts in this process
(left-padded with an attention mask, KV cache, ``do_sample``, temperature 1, no top-k/top-p,
``min_new_tokens`` = ``max_new_tokens`` = ``N_NEW``, one torch thread as the engine's model thread).
Ratio = generate's wall time / the engine's wall time (= engine tokens/s over generate tokens/s).
The two arms alternate (which goes first flips every round) for ``ROUNDS`` rounds (``BENCH_ROUNDS``),
after one untimed round of each at that concurrency (a new batch size's first pass is slower on a GPU);
every figure is the median over rounds, never a best. Latency: p50 and p99 of the engine's per-request HTTP latency
over all rounds (generate answers every prompt at once, so its latency is its wall time).
``batch_call`` is the same load sent as one SGLang batch ``/generate`` (``input_ids`` a list of lists).
The engine's own counters give prefills and decode steps per round (``N_NEW`` steps is the floor), as a
median and round by round (``per_round``: generate's and the engine's seconds, prefills, decode steps,
and the share of the engine's wall time its model thread spent in steps, ``model_busy_fraction``).
The load generator is aiohttp, whose client costs ~0.2 ms of CPU per request here; httpx (what the
rollout's ``EngineClient`` uses) costs ~5 ms per request at 128 concurrent on this machine, which
alone would make the client the bottleneck, so ``ratio_vs_batched_generate_httpx_client`` gives
the same measure with httpx as a secondary line.

Secondary lines: ``ratio_vs_sequential_generate`` (one ``model.generate`` per request, one after the
other: what the bench used to compare with), ``router_overhead_ratio`` (wall time through the real
sglang-router over straight to the engine, median of alternated rounds), ``weight_update_ms`` and
``sampler_*_ms`` (services/inference/sampling.py's ``sample`` against its full-sort reference, per call
at 128 rows of the demo's vocabulary, alternated).
``load_average`` is the machine's 1-minute load before and after: the box is shared, so absolute
tokens/s are noisy and only the side-by-side ratios mean much.

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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from services.common.embedded_redis import free_port
from services.common.sglang_router import list_workers, router_command, wait_healthy
from services.demo.tiny_model import create_tiny_model
from services.demo.warmstart import DEFAULT_HIDDEN, DEFAULT_LAYERS

ROOT = Path(__file__).resolve().parents[2]
# The engine's code: this checkout, or BENCH_ENGINE_ROOT (another checkout, for before/after figures).
ENGINE_ROOT = Path(os.environ.get("BENCH_ENGINE_ROOT", ROOT))
BATCH_CALL = os.environ.get("BENCH_BATCH_CALL", "1") == "1"  # 0: an engine without batch /generate
ENGINE_ARGS = os.environ.get("BENCH_ENGINE_ARGS", "").split()  # extra engine flags, for tuning
CONCURRENCY = tuple(int(c) for c in os.environ.get("BENCH_CONCURRENCY", "1,8,32,64,128").split(","))
# Both arms on one device and dtype (a GPU: BENCH_DEVICE=cuda BENCH_DTYPE=bfloat16), on BENCH_MODEL_DIR when set.
DEVICE, DTYPE = os.environ.get("BENCH_DEVICE", "cpu"), os.environ.get("BENCH_DTYPE", "float32")
MODEL_DIR = os.environ.get("BENCH_MODEL_DIR", "")
SECONDARY = os.environ.get("BENCH_SECONDARY", "1") == "1"  # 0: skip the per-request and httpx lines
ROUTER_LINE = True  # False: skip the router overhead and weight reload lines too (bench_gpu's variants)
HTTPX_CONCURRENCY = (32, 128)
N_NEW, MAX_BATCH = 64, 128
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
SEQUENTIAL_N = 16  # prompts for the secondary per-request generate line


def _model_dir(tmp: Path) -> Path:
    if MODEL_DIR:
        return Path(MODEL_DIR)
    demo = ROOT / "models" / "demo-ttt"
    if (demo / "config.json").is_file():
        return demo
    return create_tiny_model(tmp / "demo-arch", seed=0, hidden=DEFAULT_HIDDEN, layers=DEFAULT_LAYERS)


def prompts(n: int) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 200 for j in range(8 + i % 17)] for i in range(n)]


class Generate:
    """``model.generate`` in this process, on one torch thread (as the engine's model thread)."""

    def __init__(self, model_dir: Path) -> None:
        torch.set_num_threads(1)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[DTYPE]
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
        cfg = self.model.config
        self.pad = int(cfg.pad_token_id)
        self.cfg = GenerationConfig(max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=True, temperature=1.0,
                                    top_k=0, top_p=1.0, pad_token_id=self.pad, eos_token_id=cfg.eos_token_id)
        self.batched(prompts(4))  # warm-up

    @torch.inference_mode()
    def batched(self, batch: list[list[int]]) -> float:
        """Seconds for one left-padded batched generate of ``batch``."""
        width = max(len(p) for p in batch)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch], device=DEVICE)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=DEVICE)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, generation_config=self.cfg)
        if out.is_cuda:
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        assert out.shape[1] - width == N_NEW
        return took

    def sequential(self, batch: list[list[int]]) -> float:
        """Seconds for one generate per prompt, one after the other."""
        return sum(self.batched([p]) for p in batch)


def _body(p: list[int] | list[list[int]], seed: int) -> dict[str, Any]:
    return {"input_ids": p, "return_logprob": True, "sampling_params": {
        "max_new_tokens": N_NEW, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed}}


BENCH_TOKEN = "bench-admin-token"  # the engine's admin token (its weight updates need it)
ADMIN = {"Authorization": f"Bearer {BENCH_TOKEN}"}


class Client:
    """The load generator: aiohttp (cheap per request), or httpx (what the rollout uses) for comparison."""

    def __init__(self, use_httpx: bool = False) -> None:
        self.use_httpx = use_httpx
        # idle connections closed before the engine's keep-alive (uvicorn's default: 5 s) closes them
        self.aio = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4))
        limits = httpx.Limits(max_connections=4 * MAX_BATCH, max_keepalive_connections=4 * MAX_BATCH,
                              keepalive_expiry=4)
        self.httpx = httpx.AsyncClient(timeout=600, limits=limits, headers=ADMIN)

    async def post(self, url: str, body: dict[str, Any]) -> Any:
        if self.use_httpx:
            resp = await self.httpx.post(url, json=body)
            resp.raise_for_status()
            return resp.json()
        headers = {"content-type": "application/json", **ADMIN}
        async with self.aio.post(url, data=orjson.dumps(body), headers=headers) as r:
            r.raise_for_status()
            return orjson.loads(await r.read())

    async def get(self, url: str) -> Any:
        async with self.aio.get(url) as r:
            r.raise_for_status()
            return orjson.loads(await r.read())

    async def close(self) -> None:
        await self.aio.close()
        await self.httpx.aclose()


async def burst(http: Client, url: str, batch: list[list[int]]) -> tuple[float, list[float]]:
    """Send every prompt at once, one request each; (wall seconds, per-request latencies)."""
    async def one(i: int, p: list[int]) -> float:
        start = time.perf_counter()
        out = await http.post(f"{url}/generate", _body(p, i))
        assert len(out["output_ids"]) == N_NEW
        return time.perf_counter() - start

    start = time.perf_counter()
    lat = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    return time.perf_counter() - start, list(lat)


async def batch_call(http: Client, url: str, batch: list[list[int]]) -> float:
    """The same prompts as one SGLang batch ``/generate``; wall seconds."""
    start = time.perf_counter()
    out = await http.post(f"{url}/generate", _body(batch, 0))
    assert [len(o["output_ids"]) for o in out] == [N_NEW] * len(batch)
    return time.perf_counter() - start


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def _counters(http: Client, url: str) -> dict[str, float]:
    state = (await http.get(f"{url}/get_server_info"))["internal_states"][0]
    return {k: float(state.get(k, 0)) for k in ("prefills", "decode_steps", "busy_s")}


async def _alternated(gen: Callable[[], float], served: Callable[[], Awaitable[float]],
                      rnd: int) -> tuple[float, float]:
    """(generate seconds, served seconds), the arm that goes first flipping with the round."""
    if rnd % 2:
        s = await served()
        return gen(), s
    g = gen()
    return g, await served()


async def _rounds(gen: Generate, served: Callable[[list[list[int]]], Awaitable[float]], c: int,
                  rounds: int | None = None) -> list[tuple[float, float]]:
    """Per round: (generate's wall time, the engine's) on the same ``c`` prompts."""
    batch = prompts(c)
    return [await _alternated(lambda: gen.batched(batch), lambda: served(batch), rnd)
            for rnd in range(ROUNDS if rounds is None else rounds)]


def _median_ratio(walls: list[tuple[float, float]]) -> float:
    return statistics.median(g / e for g, e in walls)


async def _one_concurrency(http: Client, url: str, gen: Generate, c: int) -> dict[str, Any]:
    lats: list[float] = []
    steps: list[tuple[int, int, float]] = []

    async def served(batch: list[list[int]]) -> float:
        before = await _counters(http, url)
        wall, lat = await burst(http, url, batch)
        after = await _counters(http, url)
        lats.extend(lat)
        steps.append((int(after["prefills"] - before["prefills"]), int(after["decode_steps"] - before["decode_steps"]),
                      (after["busy_s"] - before["busy_s"]) / wall))
        return wall

    await _rounds(gen, served, c, rounds=1)  # untimed: this batch size's first pass in each arm
    lats.clear()
    steps.clear()
    walls = await _rounds(gen, served, c)
    calls = await _rounds(gen, lambda b: batch_call(http, url, b), c) if BATCH_CALL else []
    ratios = [g / e for g, e in walls]
    gen_s, eng_s = statistics.median(g for g, _ in walls), statistics.median(e for _, e in walls)
    return {
        "ratio_vs_batched_generate": round(statistics.median(ratios), 3),
        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "engine_tokens_per_s": round(c * N_NEW / eng_s, 1),
        "batched_generate_tokens_per_s": round(c * N_NEW / gen_s, 1),
        "p50_latency_s": round(_pct(lats, 0.5), 4), "p99_latency_s": round(_pct(lats, 0.99), 4),
        "batched_generate_latency_s": round(gen_s, 4),
        "prefills_per_round": statistics.median(p for p, _, _ in steps),
        "decode_steps_per_round": statistics.median(d for _, d, _ in steps),
        "model_busy_fraction": round(statistics.median(b for _, _, b in steps), 3),
        "per_round": [[round(g, 4), round(e, 4), p, d, round(b, 3)]
                      for (g, e), (p, d, b) in zip(walls, steps, strict=True)],
        "batch_call_ratio_vs_batched_generate": round(_median_ratio(calls), 3) if calls else None,
    }


def _start(model_dir: Path, procs: list[subprocess.Popen[bytes]]) -> tuple[str, str]:
    path = os.pathsep.join(p for p in (str(ENGINE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TANDEM_ADMIN_TOKEN": BENCH_TOKEN}
    port, rport = free_port(), free_port()
    engine = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "services.engine", "--model-path", str(model_dir), "--port", str(port),
           "--max-batch", str(MAX_BATCH), "--device", DEVICE, "--dtype", DTYPE, *ENGINE_ARGS]
    log = open(os.environ["BENCH_ENGINE_LOG"], "ab") if os.environ.get("BENCH_ENGINE_LOG") else subprocess.DEVNULL
    procs.append(subprocess.Popen(cmd, env=env, cwd=ENGINE_ROOT, stdout=log, stderr=log))
    procs.append(subprocess.Popen(router_command(rport, [engine]), env=env, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return engine, f"http://127.0.0.1:{rport}"


async def _router_and_update(http: Client, engine: str, router: str, model_dir: Path) -> dict[str, float]:
    batch, direct, routed = prompts(32), [], []
    for rnd in range(3):
        pair = [burst(http, engine, batch), burst(http, router, batch)]
        for arm in (pair if rnd % 2 == 0 else pair[::-1]):
            (direct if arm is pair[0] else routed).append((await arm)[0])
    times = []
    for v in range(1, 6):
        start = time.perf_counter()
        out = await http.post(f"{engine}/update_weights_from_disk",
                              {"model_path": str(model_dir), "weight_version": str(v)})
        times.append((time.perf_counter() - start) * 1000)
        assert out["success"], out
    return {"router_overhead_ratio": round(statistics.median(r / d for r, d in zip(routed, direct, strict=True)), 3),
            "weight_update_ms": round(statistics.median(times), 1)}


async def _secondary(http: Client, engine: str, router: str, model_dir: Path, gen: Generate) -> dict[str, Any]:
    if not SECONDARY:
        return await _router_and_update(http, engine, router, model_dir) if ROUTER_LINE else {}
    seq_batch = prompts(SEQUENTIAL_N)
    seq = [await _alternated(lambda: gen.sequential(seq_batch),
                             lambda: _wall(burst(http, engine, seq_batch)), rnd) for rnd in range(2)]
    http.use_httpx = True
    with_httpx = {str(c): round(_median_ratio(
        await _rounds(gen, lambda b: _wall(burst(http, engine, b)), c, rounds=3)), 3) for c in HTTPX_CONCURRENCY}
    http.use_httpx = False
    return {"ratio_vs_sequential_generate": round(statistics.median(g / e for g, e in seq), 2),
            "ratio_vs_batched_generate_httpx_client": with_httpx,
            **await _router_and_update(http, engine, router, model_dir)}


async def _served(model_dir: Path, engine: str, router: str, gen: Generate) -> dict[str, Any]:
    await wait_healthy(engine, timeout=120)
    await wait_healthy(router, timeout=60)
    for _ in range(600):
        if await list_workers(router, healthy_only=True):
            break
        await asyncio.sleep(0.2)
    http = Client()
    try:
        for use_httpx in (True, False):  # warm-up: connections and the engine's first batch
            http.use_httpx = use_httpx
            await burst(http, engine, prompts(MAX_BATCH))
        if BATCH_CALL:
            await batch_call(http, engine, prompts(8))
        by_c = {str(c): await _one_concurrency(http, engine, gen, c) for c in CONCURRENCY}
        return {"by_concurrency": by_c, **await _secondary(http, engine, router, model_dir, gen)}
    finally:
        await http.close()


async def _wall(run: Awaitable[tuple[float, list[float]]]) -> float:
    return (await run)[0]


def sampler_figures(rows: int = MAX_BATCH, vocab: int = 264, reps: int = 200) -> dict[str, float]:
    """Per-call milliseconds of the sampler against its full-sort reference on one thread, alternated
    (``rows`` x ``vocab`` logits: the demo model's vocabulary at the full batch)."""
    from services.inference.sampling import sample, sample_sorted

    torch.set_num_threads(1)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    out: dict[str, float] = {}
    for label, (t, p, k) in {"unrestricted": (1.0, 1.0, -1), "top_p_top_k": (0.7, 0.9, 30)}.items():
        arms: dict[str, list[float]] = {"fast": [], "sorted": []}
        for rnd in range(6):
            for name, fn in (("fast", sample), ("sorted", sample_sorted))[::1 if rnd % 2 else -1]:
                start = time.perf_counter()
                for _ in range(reps // 6):
                    fn(logits, [t] * rows, [p] * rows, [k] * rows, gens)
                arms[name].append((time.perf_counter() - start) / (reps // 6) * 1000)
        out[f"sampler_{label}_ms"] = round(statistics.median(arms["fast"]), 3)
        out[f"sampler_{label}_full_sort_ms"] = round(statistics.median(arms["sorted"]), 3)
    return out


def run() -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(Path(tmp))
        gen = Generate(model_dir)
        try:
            served = asyncio.run(_served(model_dir, *_start(model_dir, procs), gen))
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    by_c = served.pop("by_concurrency")
    return {"model": str(model_dir.name), "new_tokens": N_NEW, "rounds": ROUNDS, "max_batch": MAX_BATCH,
            "ratio_vs_batched_generate": {c: v["ratio_vs_batched_generate"] for c, v in by_c.items()},
            "engine_tokens_per_s": {c: v["engine_tokens_per_s"] for c, v in by_c.items()},
            "device": DEVICE, "dtype": DTYPE, "by_concurrency": by_c, **served,
            **(sampler_figures() if DEVICE == "cpu" else {}),
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "seconds": round(time.perf_counter() - started, 1)}


if __name__ == "__main__":
    print(orjson.dumps(run(), option=orjson.OPT_INDENT_2).decode())
