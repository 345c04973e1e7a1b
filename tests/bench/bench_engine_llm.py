"""Engine figures on a real chat model: prefix reuse over a dialogue, and the engine against a batched generate.

Runs the embedded engine in process (``services.inference.generator.Engine``), so it needs only torch,
transformers, pydantic and the project's inference modules, on a CPU or a GPU:

    python tests/bench/bench_engine_llm.py                        # SmolLM2-135M-Instruct (else the tiny model)
    python tests/bench/bench_engine_llm.py --model tiny           # the demo's tiny model
    python tests/bench/bench_engine_llm.py --device cuda --dtype bf16 --arch qwen3-0.6b   # random weights

Figures (the arms of each alternate round by round; each figure is a median over ``--rounds``):

* ``prefill_tokens_per_turn_ratio``: a 10-turn dialogue (``--dialogues`` played at once, each turn's prompt the
  previous prompt, the reply and a new user message): prompt tokens the engine prefilled ÷ new prompt tokens
  (turn 1's whole prompt, then each user message). 1.0 is the floor; re-prefilling costs about turns / 2.
* ``dialogue_turns_per_s_ratio``: turns per second of those dialogues with the prefix cache ÷ the same engine
  with its cache off (every turn re-prefills its whole conversation).
* ``llm_ratio_vs_batched_generate_c{8,32}``: ``c`` requests at once (``--prompt-len`` tokens, ``--new`` new
  tokens, temperature 1, logprobs, ignore_eos, each its own seed) through the engine ÷ one left-padded
  ``model.generate`` of the same prompts (``do_sample``, same model object, same torch threads): generate's
  wall time over the engine's.

``--arch qwen3-0.6b`` builds a Qwen3-0.6B-shaped model (28 layers, hidden 1024, GQA 16/8, vocab 151,936)
with random weights from its config (nothing downloaded) and a small word-level tokenizer; speed does not
depend on the weights' values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen3Config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.inference.generator import Engine, GenRequest  # noqa: E402

SMOLLM2 = Path(os.environ.get("BENCH_LLM_DIR", "/work/models/smollm2-135m-instruct"))
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=1,
                 pad_token_id=0, bos_token_id=2)


def _tokenizer(out: Path) -> None:
    """A small word-level tokenizer (the engine reads pad and eos from it; prompts here are token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": 3 + i for i in range(256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            bos_token="<bos>").save_pretrained(out)


def build_arch(arch: str, out: Path, dtype: str) -> Path:
    """A model of ``arch``'s shape with random weights, saved as an HF directory in ``out``."""
    if arch != "qwen3-0.6b":
        raise SystemExit(f"--arch: unknown {arch!r} (known: qwen3-0.6b)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_06B), dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    _tokenizer(out)
    return out


def model_dir(args: argparse.Namespace, tmp: Path) -> tuple[Path, str]:
    if args.arch:
        return build_arch(args.arch, tmp / args.arch, DTYPES[args.dtype]), args.arch
    if args.model == "tiny" or (args.model == "smollm2" and not (SMOLLM2 / "config.json").is_file()):
        from services.demo.tiny_model import create_tiny_model  # the demo's tiny model (CPU runs only)

        return create_tiny_model(tmp / "tiny", seed=0), "tiny"
    path = SMOLLM2 if args.model == "smollm2" else Path(args.model)
    return path, path.name


def _req(rid: str, ids: list[int], seed: int, new: int) -> GenRequest:
    return GenRequest(rid=rid, input_ids=ids, temperature=1.0, max_new_tokens=new, seed=seed, ignore_eos=True)


async def _dialogue(engine: Engine, d: int, args: argparse.Namespace, rng: random.Random) -> tuple[int, int]:
    """One dialogue of ``args.turns`` turns; returns (turns, new prompt tokens)."""
    vocab = min(engine.vocab_size, 32_000)
    ids = [rng.randrange(3, vocab) for _ in range(args.system_len)]
    new_tokens = len(ids)
    for t in range(args.turns):
        r = await engine.generate(_req(f"d{d}t{t}", ids, seed=d * 100 + t, new=args.reply_len))
        user = [rng.randrange(3, vocab) for _ in range(args.user_len)]
        ids = [*ids, *r.output_ids, *user]
        new_tokens += len(user) if t < args.turns - 1 else 0
    return args.turns, new_tokens


async def dialogues(engine: Engine, args: argparse.Namespace, cached: bool, seed: int) -> dict[str, float]:
    engine.prefix.max_bytes = int(args.prefix_cache_mb * 2**20) if cached else 0
    await engine.run_op(engine.prefix.clear)
    before = engine.stats["prefill_tokens"]
    start = time.perf_counter()
    done = await asyncio.gather(*(_dialogue(engine, d, args, random.Random(seed * 1000 + d))
                                  for d in range(args.dialogues)))
    took = time.perf_counter() - start
    turns, new = sum(t for t, _ in done), sum(n for _, n in done)
    return {"turns_per_s": turns / took, "prefill_ratio": (engine.stats["prefill_tokens"] - before) / new}


async def prefix_figures(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, dict[str, float]]] = []
    for i in range(args.rounds):
        arms = ["cached", "plain"] if i % 2 == 0 else ["plain", "cached"]
        rounds.append({a: await dialogues(engine, args, a == "cached", seed=i) for a in arms})
    engine.prefix.max_bytes = int(args.prefix_cache_mb * 2**20)
    med = lambda arm, key: statistics.median(r[arm][key] for r in rounds)  # noqa: E731
    return {"prefill_tokens_per_turn_ratio": round(med("cached", "prefill_ratio"), 3),
            "prefill_tokens_per_turn_ratio_reprefill": round(med("plain", "prefill_ratio"), 3),
            "dialogue_turns_per_s_ratio": round(statistics.median(
                r["cached"]["turns_per_s"] / r["plain"]["turns_per_s"] for r in rounds), 3),
            "dialogue_turns_per_s": round(med("cached", "turns_per_s"), 3),
            "dialogue_turns_per_s_reprefill": round(med("plain", "turns_per_s"), 3)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def batched_generate(engine: Engine, prompts: list[list[int]], new: int) -> float:
    """Seconds for one left-padded ``model.generate`` of ``prompts`` on the engine's model object."""
    pad, width = engine.pad_id, max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=engine.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=engine.device)
    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, pad_token_id=pad, eos_token_id=None)
    start = time.perf_counter()
    out = engine.model.generate(ids, attention_mask=mask, generation_config=cfg)
    _sync(engine.device)
    assert out.shape[1] - width == new
    return time.perf_counter() - start


async def engine_batch(engine: Engine, prompts: list[list[int]], new: int, seed: int) -> float:
    start = time.perf_counter()
    done = await asyncio.gather(*(engine.generate(_req(f"b{seed}-{i}", p, seed=seed + i, new=new))
                                  for i, p in enumerate(prompts)))
    assert all(len(r.output_ids) == new for r in done)
    return time.perf_counter() - start


async def batched_figures(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rng = random.Random(7)
    vocab = min(engine.vocab_size, 32_000)
    for c in args.concurrency:
        ratios = []
        for i in range(args.rounds + 1):  # round 0: untimed warm-up of this batch size
            prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len - i % 3 + j % 5)] for j in range(c)]
            await engine.run_op(engine.prefix.clear)
            if i % 2 == 0:
                e = await engine_batch(engine, prompts, args.new, seed=1000 * i)
                g = await asyncio.to_thread(batched_generate, engine, prompts, args.new)
            else:
                g = await asyncio.to_thread(batched_generate, engine, prompts, args.new)
                e = await engine_batch(engine, prompts, args.new, seed=1000 * i)
            if i:
                ratios.append(g / e)
        out[f"llm_ratio_vs_batched_generate_c{c}"] = round(statistics.median(ratios), 3)
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path, name = model_dir(args, Path(tmp))
        engine = Engine(path, max_batch=max(64, max(args.concurrency)), admit_quiet_s=0.002, admit_window_s=0.02,
                        device=args.device, dtype=DTYPES[args.dtype], prefix_cache_mb=args.prefix_cache_mb)
    try:
        load = os.getloadavg()[0]
        figures: dict[str, Any] = {"model": name, "device": args.device, "dtype": DTYPES[args.dtype]}
        if args.device == "cuda":
            figures["gpu"] = torch.cuda.get_device_name()
        started = time.perf_counter()
        if "dialogue" in args.parts:
            figures |= await prefix_figures(engine, args)
        if "batched" in args.parts:
            figures |= await batched_figures(engine, args)
        figures |= {"load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
                    "seconds": round(time.perf_counter() - started, 1)}
        return figures
    finally:
        engine.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 (the default; the tiny model if it is absent), "
                   "tiny, or an HF model directory")
    p.add_argument("--arch", default="", help="qwen3-0.6b: a model of that shape with random weights")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dialogues", type=int, default=2, help="dialogues played at once")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-len", type=int, default=32)
    p.add_argument("--user-len", type=int, default=16)
    p.add_argument("--reply-len", type=int, default=8)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--prefix-cache-mb", type=float, default=256.0)
    p.add_argument("--parts", type=lambda s: s.split(","), default=["dialogue", "batched"],
                   help="dialogue (the prefix figures), batched (the figures against model.generate)")
    return p


def run() -> dict[str, Any]:
    """``make bench``'s entry (a section): ``engine.*`` on SmolLM2 when present, ``engine.tiny.*`` on the tiny model."""
    out: dict[str, Any] = {"tiny": asyncio.run(measure(parser().parse_args(["--model", "tiny"])))}
    if (SMOLLM2 / "config.json").is_file():
        out |= asyncio.run(measure(parser().parse_args(["--model", "smollm2"])))
    return {"engine": out}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(measure(parser().parse_args())), indent=2))
