"""GPU figures (issue 16 item 7; docs/architecture.md §9): the engine, the trainers, weight reloads, the demo.

Run on a machine with a CUDA GPU (none of this runs in ``make bench``: CI has no GPU)::

    PYTHONPATH=. python tests/bench/bench_gpu.py --out build/gpu.json [--parts engine,trainer,system] [--smoke]

The model is one of Qwen3-0.6B's architecture (28 layers, hidden 1024, 16 query and 8 KV heads of 128,
FFN 3072, vocabulary 151,936, tied embeddings), built from its config with random weights and saved in
bfloat16 (as the published checkpoint is), with the demo's byte-level tokenizer: speed does not depend
on the weights' values, and nothing is downloaded. ``--smoke`` uses a 2-layer model of the same family
and short runs, to check the paths in a minute.

- ``engine``: ``tests/bench/bench_engine.py`` with both arms on the GPU in bfloat16: the embedded engine
  (``embedded.device: cuda``) over HTTP against one batched ``model.generate`` on the same prompts, at
  1-128 concurrent requests, arms alternated, medians over rounds; its ``weight_update_ms`` is the disk
  reload of the whole checkpoint (``/update_weights_from_disk``, page cache warm). ``--engine-variants``
  runs the single-request line again for other engine flags, in the same run: ``NAME|FLAGS|C1,C2;...``
  (e.g. ``fast|--http httptools --loop uvloop|32,128``).
- ``trainer``: ``tests/bench/bench_trainer.py`` on the GPU: tokens/s and MFU of the torch backend in
  float32 and bf16 autocast, and of the megatron backend in bf16 autocast (when megatron-core imports),
  with the demo's batch in 4 minibatches (``BENCH_GPU_MINIBATCHES`` for others; ``BENCH_GPU_TRAINER_ARMS``
  for other arms, e.g. ``torch:bfloat16`` alone, whose one policy fits the whole batch in one pass).
- ``system``: ``tests/bench/bench_system.py`` with the demo (its tiny model) once with engines and
  trainers on the CPU and once on the GPU, against the in-process loop.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def build_model(path: Path, smoke: bool) -> Path:
    """A Qwen3-0.6B-architecture model (2 layers under ``--smoke``) with random weights, saved in bfloat16."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from services.demo.tiny_model import build_config, build_tokenizer

    tokenizer = build_tokenizer()
    base = build_config(tokenizer).to_dict()
    cfg = Qwen3Config(**{k: base[k] for k in ("eos_token_id", "pad_token_id", "bos_token_id")},
                      **{**QWEN3_0_6B, **({"num_hidden_layers": 2} if smoke else {})})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def gpu_info() -> dict[str, Any]:
    import torch
    import transformers

    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "cpu_cores": os.cpu_count()}


def part_engine(model: Path, smoke: bool, variants: str = "") -> dict[str, Any]:
    log_path = Path(os.environ.get("BENCH_ENGINE_LOG", model.parent / "engine.log"))
    os.environ.update(BENCH_DEVICE="cuda", BENCH_DTYPE="bfloat16", BENCH_MODEL_DIR=str(model), BENCH_SECONDARY="0",
                      BENCH_ENGINE_LOG=str(log_path))
    if smoke:
        os.environ["BENCH_CONCURRENCY"] = "1,8"
    from tests.bench import bench_engine

    if smoke:
        bench_engine.ROUNDS = 2
    try:
        out = bench_engine.run()
        for variant in filter(None, variants.split(";")):  # the single-request line under other engine flags
            name, flags, conc = variant.split("|")
            bench_engine.ENGINE_ARGS, bench_engine.BATCH_CALL, bench_engine.ROUTER_LINE = flags.split(), False, False
            bench_engine.CONCURRENCY = tuple(int(c) for c in conc.split(","))
            out[f"variant_{name}"] = {"flags": flags, **bench_engine.run()}
            print(json.dumps({f"variant_{name}": out[f"variant_{name}"]}, default=str), flush=True)
        return out
    except Exception as exc:
        log = log_path.read_text(errors="replace")[-2500:]
        raise RuntimeError(f"{exc}; the engine's log ends:\n{log}") from exc


def part_trainer(model: Path, smoke: bool) -> dict[str, Any]:
    import torch

    arms = ["torch:float32", "torch:bfloat16"]
    try:
        import services.training.megatron  # noqa: F401
        arms.append("megatron:bfloat16")
    except ImportError as exc:
        print(f"megatron-core does not import here ({exc}); its arm is left out", flush=True)
    arms = os.environ.get("BENCH_GPU_TRAINER_ARMS", "").split(",") if os.environ.get("BENCH_GPU_TRAINER_ARMS") else arms
    os.environ.update(BENCH_TRAINER_DEVICE="cuda", BENCH_TRAINER_MODEL_DIR=str(model),
                      BENCH_TRAINER_ARMS=",".join(arms))
    from tests.bench import bench_trainer

    out: dict[str, Any] = {"arms": arms}
    # 4: about 2,200 tokens a pass. 1 (the whole batch, 8,672 tokens, in one pass) ran out of the H100's 80 GB
    # with the three arms resident: the fp32 log-softmax and entropy over the 151,936-token vocabulary.
    for minibatches in (int(m) for m in os.environ.get("BENCH_GPU_MINIBATCHES", "4").split(",")):
        bench_trainer.MINIBATCHES = minibatches
        out[f"minibatches_{minibatches}"] = bench_trainer.run(2 if smoke else 5)
        gc.collect()  # the arms' policies (AdamW and its scheduler hold cycles) leave the GPU before the next
        torch.cuda.empty_cache()
    return out


def part_system(smoke: bool) -> dict[str, Any]:
    os.environ.update(BENCH_SYSTEM_DEVICES="cpu,cuda", BENCH_SYSTEM_ASYNC="0",
                      BENCH_SYSTEM_STEPS="3" if smoke else "6")
    from tests.bench import bench_system

    return bench_system.run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="engine,trainer,system")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--engine-variants", default="", help="NAME|FLAGS|C1,C2;... (see the module docstring)")
    args = ap.parse_args()
    out: dict[str, Any] = {"info": gpu_info(), "smoke": args.smoke}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        model = build_model(Path(tmp) / "qwen3-0.6b-arch", args.smoke)
        for part in args.parts.split(","):
            started = time.perf_counter()
            try:
                fn = {"engine": lambda: part_engine(model, args.smoke, args.engine_variants),
                      "trainer": lambda: part_trainer(model, args.smoke),
                      "system": lambda: part_system(args.smoke)}[part]
                out[part] = fn()
            except Exception as exc:  # one part failing still reports the others
                out[part] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            out[part]["seconds"] = round(time.perf_counter() - started, 1)
            print(json.dumps({part: out[part]}, indent=1, default=str), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
