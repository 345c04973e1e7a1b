"""Command lines of the processes a rollout service starts: its engines (and, via
``services.common.sglang_router.router_command``, its router).

``engine: embedded``  -> ``python -m services.engine --model-path M --port P --engine-id A-i --agent A --device D
                          --dtype T [--shared-with B ...]`` (it loads only A's signed versions, and the signed
                          adapters of the agents sharing A's engines: services/common/weights_auth.py)
``engine: sglang``    -> ``python -m sglang.launch_server --model-path M --host H --port P --tp-size T
                          --mem-fraction-static F --base-gpu-id G [--enable-lora --max-lora-rank R
                          --lora-target-modules M...] [extra_args...]``
where engine i of an agent uses GPUs ``base_gpu_id + i*tp_size`` .. ``+ tp_size - 1``.
"""

from __future__ import annotations

import sys

from services.contracts.config import AgentConfig


def engine_command(acfg: AgentConfig, agent: str, index: int, port: int, host: str = "127.0.0.1",
                   shared_with: tuple[str, ...] = ()) -> list[str]:
    """The argv that starts engine ``index`` of ``agent`` on ``port`` (``shared_with``: the agents sharing it)."""
    if acfg.engine == "embedded":
        return [sys.executable, "-m", "services.engine", "--model-path", acfg.model_path, "--host", host,
                "--port", str(port), "--engine-id", f"{agent}-{index}", "--agent", agent,
                "--max-batch", str(acfg.max_inflight_per_engine),
                "--device", acfg.embedded.device, "--dtype", acfg.embedded.dtype,
                "--prefix-cache-mb", str(acfg.embedded.prefix_cache_mb),
                *(["--step-delay-ms", str(acfg.embedded.step_delay_ms)] if acfg.embedded.step_delay_ms else []),
                *(arg for other in shared_with for arg in ("--shared-with", other))]
    sg = acfg.sglang
    lora = ([] if acfg.lora is None else  # adapters load at run time (/load_lora_adapter): declare their shape
            ["--enable-lora", "--max-lora-rank", str(acfg.lora.r), "--lora-target-modules", *acfg.lora.target_modules])
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", acfg.model_path, "--host", host,
            "--port", str(port), "--tp-size", str(sg.tp_size), "--mem-fraction-static", str(sg.mem_fraction_static),
            "--base-gpu-id", str(sg.base_gpu_id + index * sg.tp_size), *lora, *sg.extra_args]
