"""What an idle Tinker client costs ``tandem serve``: memory per training client, disk per sampler snapshot.

``python -m tests.bench.tinker_idle_clients MODEL_DIR [--clients N] [--rank R]`` starts a server (its
own process, an embedded Redis), makes N LoRA clients with the SDK, gives each one SFT step (so its
AdamW state exists) and one ``save_weights_and_get_sampling_client`` (an ephemeral snapshot, no
engine loaded), and prints the server's resident memory after each client and the disk each
client's snapshot takes. Then it finishes the session and prints what is left.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import tinker
from tinker import types

from services.common.embedded_redis import EmbeddedRedis
from tests.tinker_server import TinkerServer


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def du_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rank", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        redis = EmbeddedRedis(data_dir=Path(tmp) / "redis").start()
        srv = TinkerServer(redis.url, Path(tmp) / "serve").start()
        try:
            assert srv.proc is not None
            pid = srv.proc.pid
            service = tinker.ServiceClient(base_url=srv.url, api_key="tml-measure")
            ids = list(range(100, 164))
            datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
            rows = [{"clients": 0, "rss_mib": round(rss_mib(pid), 1)}]
            for i in range(args.clients):
                tc = service.create_lora_training_client(base_model=args.model_dir, rank=args.rank, seed=i).result()
                tc.forward_backward([datum], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                tc.save_weights_and_get_sampling_client().result()
                time.sleep(1.0)
                snap = srv.data_dir / "runs" / tc.model_id / "sampler_weights"
                rows.append({"clients": i + 1, "rss_mib": round(rss_mib(pid), 1),
                             "snapshot_mib": round(du_mib(snap), 1)})
                print(json.dumps(rows[-1]), flush=True)
            service.close("success").result()
            time.sleep(1.0)
            left = du_mib(srv.data_dir / "runs")
            health = httpx.get(srv.url + "/health").json()
            print(json.dumps({"after_close": True, "rss_mib": round(rss_mib(pid), 1), "runs_disk_mib": round(left, 1),
                              "models_loaded": health["models_loaded"]}))
            per = (rows[-1]["rss_mib"] - rows[1]["rss_mib"]) / max(1, args.clients - 1)
            print(json.dumps({"first_client_rss_mib": round(rows[1]["rss_mib"] - rows[0]["rss_mib"], 1),
                              "each_further_client_rss_mib": round(per, 1)}))
        finally:
            srv.stop()
            redis.stop()


if __name__ == "__main__":
    main()
