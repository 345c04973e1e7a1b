"""The compatibility table of ``tandem serve`` against every public method of the tinker 0.38 SDK's clients.

The test walks ``ServiceClient``, ``TrainingClient``, ``SamplingClient`` and ``RestClient``: every public
method must be classified here (a method a newer SDK adds fails the test until it is), and the
committed table, docs/reference/tinker_compat.md, must be the one this generates
(``TANDEM_WRITE_COMPAT=1`` rewrites it). A deprecated ``*_async`` twin shares its method's row.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import tinker

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "tinker_compat.md"
CLIENTS = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient)
SERVED, CLIENT, REFUSED, NA = "served", "client-side", "refused", "n.a."
NOT_SERVED = "answered 404 in the SDK's error shape (`NotFoundError`), its seq_id freed"
STATUS: dict[str, tuple[str, str]] = {
    "ServiceClient.close": (SERVED, "finishes the session: its models leave memory "
                                    "(tests/integration/test_tinker_api.py)"),
    "ServiceClient.copy_weights": (SERVED, "into a new session of the client's project: a hard-linked copy that "
                                           "cannot be trained (tests/integration/test_tinker_sessions.py)"),
    "ServiceClient.create_custom_loss": (SERVED, "the traced graph is rebuilt from the server's op set "
                                                "(services/tinker_api/custom_loss.py); anything else is a 400 "
                                                "naming the node (tests/integration/test_tinker_custom_loss.py)"),
    "ServiceClient.create_lora_training_client": (SERVED, "local directory or `--model` hub name"),
    "ServiceClient.create_rest_client": (CLIENT, ""),
    "ServiceClient.create_sampling_client": (SERVED, "base model or `tinker://` sampler path"),
    "ServiceClient.create_training_client_from_state": (SERVED, "tests/integration/test_tinker_durable.py"),
    "ServiceClient.create_training_client_from_state_with_optimizer": (
        SERVED, "tests/integration/test_tinker_durable.py"),
    "ServiceClient.get_console_url": (NA, "a link to Thinking Machines' console"),
    "ServiceClient.get_server_capabilities": (SERVED, "served models, hub names included"),
    "ServiceClient.get_telemetry": (CLIENT, "the events it posts are accepted and counted"),
    "TrainingClient.create_sampling_client": (SERVED, ""),
    "TrainingClient.forward": (SERVED, "losses: cross_entropy, importance_sampling, ppo, cispo, dro, gspo, and "
                                       "`custom` by its `loss_id`"),
    "TrainingClient.forward_backward": (SERVED, "as `forward`; `stable_reinforce` refused by name: Tinker "
                                                "publishes neither its objective nor the sampling-time records "
                                                "it reads"),
    "TrainingClient.forward_backward_custom": (SERVED, "a `create_custom_loss` handle runs on the server (one "
                                                       "forward_backward); a plain callable takes the SDK's "
                                                       "client-side path (a forward, then a weighted backward)"),
    "TrainingClient.get_console_url": (NA, "a link to Thinking Machines' console"),
    "TrainingClient.get_info": (SERVED, "`tokenizer_id` is the local directory"),
    "TrainingClient.get_telemetry": (CLIENT, ""),
    "TrainingClient.get_tokenizer": (SERVED, "loaded from the served model's directory"),
    "TrainingClient.load_state": (SERVED, "bit-exact (tests/integration/test_tinker_durable.py)"),
    "TrainingClient.load_state_with_optimizer": (SERVED, "bit-exact, AdamW state included"),
    "TrainingClient.optim_step": (SERVED, "AdamW; other optimizers refused with a user error"),
    "TrainingClient.save_state": (SERVED, ""),
    "TrainingClient.save_weights_and_get_sampling_client": (SERVED, "an ephemeral snapshot, collected when unused"),
    "TrainingClient.save_weights_external": (SERVED, "a PEFT adapter; age-encrypted to the given recipients"),
    "TrainingClient.save_weights_for_sampler": (SERVED, "merged HF weights"),
    "SamplingClient.compute_logprobs": (SERVED, "equal to the trainer's forward "
                                                "(tests/integration/test_tinker_api.py)"),
    "SamplingClient.create": (SERVED, ""),
    "SamplingClient.from_sampler_handle": (SERVED, "joins the sampling session by its id"),
    "SamplingClient.get_base_model": (SERVED, ""),
    "SamplingClient.get_sampler_handle": (CLIENT, ""),
    "SamplingClient.get_telemetry": (CLIENT, ""),
    "SamplingClient.get_tokenizer": (SERVED, ""),
    "SamplingClient.on_queue_state_change": (CLIENT, ""),
    "SamplingClient.sample": (SERVED, "stop, seed, top-k/p, prompt logprobs and top-k prompt logprobs; "
                                      "`topk_sample_logprobs`, `target_prompt_logprobs`, `prompt_alt_tokens_k` "
                                      "refused with a user error"),
    "RestClient.assign_session_project": (SERVED, "stored on the session (tests/integration/test_tinker_sessions.py)"),
    "RestClient.copy_weights": (SERVED, "to a destination project (a new session) or a session's model_seq_id; "
                                        "hard links, no bytes copied"),
    "RestClient.delete_checkpoint": (SERVED, ""),
    "RestClient.delete_checkpoint_from_tinker_path": (SERVED, "tests/integration/test_tinker_weights_out.py"),
    "RestClient.export_session_trace": (SERVED, "the session's recorded requests as Chrome trace-event JSON "
                                                "(Perfetto opens it), by signed URL"),
    "RestClient.get_audit_log": (NA, NOT_SERVED + " (no accounts here)"),
    "RestClient.get_billing_usage": (NA, NOT_SERVED + " (no billing here)"),
    "RestClient.get_current_checkpoint_storage_usage": (SERVED, "live checkpoints' count and bytes by project; "
                                                               "no cost (no billing here)"),
    "RestClient.get_external_weights_urls": (SERVED, "signed URLs, one hour, no API key needed"),
    "RestClient.get_sampler": (SERVED, ""),
    "RestClient.get_server_capabilities": (SERVED, ""),
    "RestClient.get_session": (SERVED, "training runs, sampling sessions, user metadata, display name"),
    "RestClient.get_telemetry": (CLIENT, ""),
    "RestClient.get_training_run": (SERVED, ""),
    "RestClient.get_training_run_by_tinker_path": (SERVED, ""),
    "RestClient.get_weights_info_by_tinker_path": (SERVED, "tests/integration/test_tinker_weights_out.py"),
    "RestClient.list_checkpoints": (SERVED, "tests/integration/test_tinker_weights_out.py"),
    "RestClient.list_sessions": (SERVED, "newest first"),
    "RestClient.list_training_runs": (SERVED, "tests/integration/test_tinker_weights_out.py"),
    "RestClient.list_user_checkpoints": (SERVED, "every model's checkpoints"),
    "RestClient.publish_checkpoint_from_tinker_path": (SERVED, "the `public` flag of the checkpoint's listing"),
    "RestClient.search_sessions": (SERVED, "one identity here (`local`): own and accessible are every session; "
                                           "active = a heartbeat in the last 2 minutes"),
    "RestClient.set_checkpoint_ttl_from_tinker_path": (SERVED, "an expired checkpoint is deleted"),
    "RestClient.unpublish_checkpoint_from_tinker_path": (SERVED, "clears the `public` flag"),
    "RestClient.whoami": (SERVED, "the SDK reads the claims of the JWT it trades its key for "
                                  "(`/api/v1/auth/token`, `jwt_auth`): `tml:user:local` on an open server, one "
                                  "principal per API key otherwise (tests/integration/test_tinker_auth.py)"),
}


def sdk_methods() -> dict[str, list[str]]:
    """'Client.method' -> the public names it covers (itself and its deprecated ``_async`` twin)."""
    out: dict[str, list[str]] = {}
    for cls in CLIENTS:
        names = sorted(n for n, m in inspect.getmembers(cls) if not n.startswith("_") and callable(m))
        for name in names:
            base = name.removesuffix("_async") if name.endswith("_async") and name[:-6] in names else name
            out.setdefault(f"{cls.__name__}.{base}", []).append(name)
    return out


def render() -> str:
    methods = sdk_methods()
    counts = {s: sum(1 for k in methods if STATUS[k][0] == s) for s in (SERVED, CLIENT, REFUSED, NA)}
    lines = [
        "# Tinker SDK compatibility of `tandem serve`", "",
        f"Every public method of the clients of `tinker` {tinker.__version__} (`ServiceClient`, `TrainingClient`, "
        "`SamplingClient`, `RestClient`), against Tandem's Tinker API. Generated by "
        "`tests/unit/test_tinker_compat.py` (`TANDEM_WRITE_COMPAT=1` rewrites it; the test fails when it is stale). "
        "A deprecated `*_async` twin shares its method's row.", "",
        "- **served**: the server answers it as Tinker does;",
        "- **client-side**: the SDK does it alone (nothing to serve);",
        "- **refused**: answered with the SDK's error shape at once (never a hang);",
        "- **n.a.**: a concept Tandem has no use for (accounts, billing, Thinking Machines' console); answered "
        "like a refusal.", "",
        f"{len(methods)} methods: {counts[SERVED]} served, {counts[CLIENT]} client-side, {counts[REFUSED]} "
        f"refused, {counts[NA]} n.a.", "",
        "| method | status | notes |", "| --- | --- | --- |",
    ]
    for key, names in methods.items():
        status, note = STATUS[key]
        twins = f" (and `{names[1]}`)" if len(names) > 1 else ""
        lines.append(f"| `{key}`{twins} | {status} | {note} |")
    return "\n".join(lines) + "\n"


def test_every_public_sdk_method_is_classified():
    methods = sdk_methods()
    assert sorted(set(methods) - set(STATUS)) == [], "SDK methods missing from the table"
    assert sorted(set(STATUS) - set(methods)) == [], "table rows that are no SDK method"


def test_the_committed_table_is_current():
    text = render()
    if os.environ.get("TANDEM_WRITE_COMPAT") == "1":
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(text)
    assert DOC.is_file() and DOC.read_text() == text, "docs/reference/tinker_compat.md is stale: " \
        "TANDEM_WRITE_COMPAT=1 pytest tests/unit/test_tinker_compat.py"
