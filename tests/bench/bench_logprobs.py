"""Peak memory of the trainer's token logprobs + entropy pass, whole against row chunks (services/training/grpo.py).

One process per arm (a fresh process's peak resident size is its arm's alone; arms alternated over ``ROUNDS``):
a [``ROWS`` x ``VOCAB``] float32 logits leaf (Qwen3's 151,936-token vocabulary), the logprobs of the training
loss with their backward, and the entropy without one (as the trainers take it when there is no entropy
bonus). ``peak_ratio_chunked_over_whole`` is the chunked arm's peak resident size over the whole arm's, each
less the process's size before the logits existed; ``seconds_ratio...`` the same for the time.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS, VOCAB, ROUNDS = 1024, 151936, 3


def arm(chunked: bool) -> dict[str, float]:
    import torch

    from services.training.grpo import CHUNK_LOGITS, token_entropy, token_logprobs

    torch.set_num_threads(1)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logits = torch.randn(1, ROWS, VOCAB, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (1, ROWS), generator=torch.Generator().manual_seed(1))
    chunk = CHUNK_LOGITS if chunked else logits.numel()
    start = time.perf_counter()
    logp = token_logprobs(logits, targets, 1.0, chunk_logits=chunk)
    with torch.no_grad():  # as the trainers take it without an entropy bonus (logged, no gradient)
        token_entropy(logits.detach(), 1.0, chunk_logits=chunk)
    logp.sum().backward()
    took = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mb": (peak - base) / 1024, "seconds": took, "logits_mb": logits.numel() * 4 / 2**20}


def run() -> dict[str, float]:
    rows: dict[str, list[dict[str, float]]] = {"whole": [], "chunked": []}
    for rnd in range(ROUNDS):
        for name in (("whole", "chunked") if rnd % 2 == 0 else ("chunked", "whole")):
            out = subprocess.run([sys.executable, __file__, name], cwd=ROOT, capture_output=True, text=True,
                                 check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
            rows[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in rows.items()}
    return {"logits_mb": round(med["whole"]["logits_mb"], 1),
            "whole_peak_mb": round(med["whole"]["peak_mb"], 1), "chunked_peak_mb": round(med["chunked"]["peak_mb"], 1),
            "peak_ratio_chunked_over_whole": round(med["chunked"]["peak_mb"] / med["whole"]["peak_mb"], 3),
            "seconds_ratio_chunked_over_whole": round(med["chunked"]["seconds"] / med["whole"]["seconds"], 3)}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(arm(sys.argv[1] == "chunked")))
    else:
        print(json.dumps(run(), indent=2))
