"""Peak memory of one LoRA GRPO training step with and without ``trainer.micro_batch_size``.

    PYTHONPATH=$PWD python tests/bench/bench_micro_batch.py [--layers 8] [--sizes 0 8 4 2] [--out FILE]

The model is a llama with SmolLM2-135M's vocabulary (49,152 tokens) and widths (hidden 576, MLP 1536, 9 heads,
3 key/value heads, tied embeddings), random weights (nothing is downloaded), ``--layers`` of its 30 layers; LoRA
r 8 on q/k/v/o; float32 on the CPU. One batch: ``--samples`` sequences of ``--seq`` random tokens, the first half
of each masked as the prompt, rewards in groups of 8; one minibatch (one optimizer step). Each micro-batch size
(0: the whole minibatch in one pass) runs in a process of its own, which reports its peak RSS (``ru_maxrss``;
the model's load peaks far lower), that peak above its RSS before the step, the step's ``activation_mb`` (the
largest micro-batch's saved-for-backward storages: services/training/memory.py), its seconds, and the loss and
gradient norm (equal across sizes: the same update).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.contracts.agent_parts import TrainerConfig  # noqa: E402
from services.contracts.config import AgentConfig, AlgorithmConfig, LoraConfig  # noqa: E402
from services.contracts.messages import Sample  # noqa: E402
from services.training.backends import make_policy  # noqa: E402

VOCAB = 49152


def make_model(out: Path, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.demo.tiny_model import build_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out


def batch(samples: int, seq: int) -> list[Sample]:
    rng = random.Random(0)
    prompt = seq // 2
    return [Sample(agent="A", role="X", episode_id=f"e{i}", group_id=f"g{i // 8}", group_samples=8,
                   tokens=[rng.randrange(VOCAB) for _ in range(seq)], loss_mask=[0] * prompt + [1] * (seq - prompt),
                   rollout_logprobs=[0.0] * prompt + [-10.8] * (seq - prompt), reward=float(rng.random() < 0.5),
                   weight_versions=[0]) for i in range(samples)]


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def child(model: Path, size: int, samples: int, seq: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    policy = make_policy(AgentConfig(model_path=str(model), seed=0, algorithm=AlgorithmConfig(lr=1e-4),
                                     lora=LoraConfig(r=8, alpha=16), trainer=TrainerConfig(micro_batch_size=size)),
                         1.0)
    data = batch(samples, seq)
    before = rss_mb()
    start = time.perf_counter()
    m = policy.train_step(data)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"micro_batch_size": size, "peak_rss_mb": round(peak, 1), "step_peak_rss_mb": round(peak - before, 1),
            "rss_before_mb": round(before, 1),
            "activation_mb": m["activation_mb"], "seconds": round(seconds, 1), "loss": m["loss"],
            "grad_norm": m["grad_norm"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 8, 4, 2])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq", type=int, default=100)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", type=int)
    ap.add_argument("--model", type=Path)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.model, a.child, a.samples, a.seq)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", a.layers)
        for size in a.sizes:
            out = subprocess.run([sys.executable, __file__, "--child", str(size), "--model", str(model),
                                  "--samples", str(a.samples), "--seq", str(a.seq)],
                                 check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    result = {"layers": a.layers, "vocab": VOCAB, "samples": a.samples, "seq": a.seq, "runs": rows,
              **{f"{k}_ratio": {r["micro_batch_size"]: round(r[k] / rows[0][k], 3) for r in rows}
                 for k in ("peak_rss_mb", "step_peak_rss_mb", "activation_mb")}}
    print(json.dumps({k: v for k, v in result.items() if k.endswith("_ratio")}))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
