"""Sessions, projects, published checkpoints and weight copies through the unmodified tinker 0.38 ``RestClient``.

One live ``tandem serve`` (the suite's Redis, the tiny demo model); the SDK's own calls:
``get_session``, ``list_sessions``, ``search_sessions``, ``assign_session_project``,
``export_session_trace``, ``get_current_checkpoint_storage_usage``,
``publish``/``unpublish_checkpoint_from_tinker_path`` and ``copy_weights``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from services.common.embedded_redis import EmbeddedRedis
from tests.helpers import tinker_server
from tests.tinker_server import TinkerServer

KEY = "tml-tandem-sessions"
IDS = [60 + (7 * i) % 50 for i in range(24)]


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    url = redis_server.url.rsplit("/", 1)[0] + "/14"  # a database of its own: the suite's flushes never hit it
    with tinker_server(url, tmp_path_factory.mktemp("tinker-sessions")) as srv:
        yield srv


def logprobs(tc: tinker.TrainingClient) -> np.ndarray:
    datum = types.Datum(model_input=types.ModelInput.from_ints(IDS[:-1]),
                        loss_fn_inputs={"target_tokens": IDS[1:], "weights": [1.0] * (len(IDS) - 1)})
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def trained_client(svc: tinker.ServiceClient, tiny_model_dir: Path) -> tinker.TrainingClient:
    tc = svc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=40).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(IDS[:-1]),
                        loss_fn_inputs={"target_tokens": IDS[1:], "weights": [1.0] * (len(IDS) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc


def test_sessions_are_read_searched_and_moved(server: TinkerServer, tiny_model_dir: Path):
    first = tinker.ServiceClient(base_url=server.url, api_key=KEY, user_metadata={"team": "a"}, project_id="proj-x",
                                 display_name="Tic Tac Toe run")
    second = tinker.ServiceClient(base_url=server.url, api_key=KEY, user_metadata={"team": "b"})
    sid, other = first.holder.get_session_id(), second.holder.get_session_id()
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    try:
        tc = trained_client(first, tiny_model_dir)
        tc.save_state("s1").result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        sampler.compute_logprobs(types.ModelInput.from_ints(IDS[:4])).result()  # its snapshot is saved by now
        got = rest.get_session(sid).result()
        assert got.training_run_ids == [tc.model_id] and got.user_metadata == {"team": "a"}
        assert got.sampler_ids == [f"{sid}:sample:0"]  # the snapshot's sampling session
        assert got.display_name == "Tic Tac Toe run"
        assert rest.list_sessions(limit=2).result().sessions == [other, sid]  # newest first
        assert rest.list_sessions(limit=1, offset=1).result().sessions == [sid]
        with pytest.raises(tinker.NotFoundError):
            rest.get_session("nobody").result()
        found = rest.search_sessions(types.SessionSearchRequest(display_name="tic TOE")).result()
        assert [s.session_id for s in found.sessions] == [sid] and found.next_cursor is None
        hit = found.sessions[0]
        assert hit.project_id == "proj-x" and hit.status is not None and hit.status.type == "active"
        assert hit.checkpoints_count == 2 and hit.checkpoint_storage_bytes > 0  # the save and the snapshot
        search = rest.search_sessions
        assert [s.session_id for s in search(types.SessionSearchRequest(user_metadata={"team": "b"})).result()
                .sessions] == [other]
        page = search(types.SessionSearchRequest(session_id=sid, display_name="nothing like it")).result()
        assert [s.session_id for s in page.sessions] == [sid]  # either one matches
        trace = httpx.get(rest.export_session_trace(sid).result()).json()  # a signed URL: no API key
        slices = [(e["name"], e["args"]["seq_id"]) for e in trace["traceEvents"] if e["ph"] == "X"]
        assert slices[:4] == [("create_model", 0), ("forward_backward", 1), ("optim_step", 2), ("save_weights", 3)]
        assert ("save_for_sampler", 4) in slices and any(name == "sample" for name, _ in slices)
        tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert tracks == {tc.model_id, f"{sid}:sample:0"}
        usage = {u.project_id: u for u in rest.get_current_checkpoint_storage_usage().result().data}
        assert usage["proj-x"].checkpoint_count == 2 and usage["proj-x"].size_bytes == hit.checkpoint_storage_bytes
        rest.assign_session_project(sid, "proj-y").result()
        moved = search(types.SessionSearchRequest(project_ids=["proj-y"])).result()
        assert [s.session_id for s in moved.sessions] == [sid]
        second.close("success").result()
        done = search(types.SessionSearchRequest(statuses=[types.ClientFinishedSessionStatusQuery()])).result()
        assert other in [s.session_id for s in done.sessions] and sid not in [s.session_id for s in done.sessions]
        one = search(types.SessionSearchRequest(limit=1)).result()
        assert [s.session_id for s in one.sessions] == [other] and one.next_cursor is not None
        rest_page = search(types.SessionSearchRequest(limit=1, cursor=one.next_cursor)).result()
        assert [s.session_id for s in rest_page.sessions] == [sid]
    finally:
        first.close("success").result()


def test_checkpoints_are_published_and_copied(server: TinkerServer, tiny_model_dir: Path):
    svc = tinker.ServiceClient(base_url=server.url, api_key=KEY, project_id="proj-archive")
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    try:
        tc = trained_client(svc, tiny_model_dir)
        state = tc.save_state("keep").result().path
        snap = tc.save_weights_for_sampler("snap").result().path

        def public() -> dict[str, bool]:
            return {c.tinker_path: c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints}

        assert public() == {state: False, snap: False}
        rest.publish_checkpoint_from_tinker_path(snap).result()
        assert public() == {state: False, snap: True}
        rest.unpublish_checkpoint_from_tinker_path(snap).result()
        assert public() == {state: False, snap: False}
        with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
            rest.publish_checkpoint_from_tinker_path(f"tinker://{tc.model_id}/weights/none").result()

        copy = svc.copy_weights(state, ttl_seconds=7200).result()
        assert copy != state and copy.endswith("/weights/keep")
        run = rest.get_training_run_by_tinker_path(copy).result()
        assert run.base_model == str(tiny_model_dir) and run.training_run_id != tc.model_id
        copied = rest.list_checkpoints(run.training_run_id).result().checkpoints
        assert [c.tinker_path for c in copied] == [copy] and copied[0].expires_at is not None
        src = server.data_dir / "runs" / tc.model_id / "weights" / "keep" / "tinker_state.pt"
        dst = server.data_dir / "runs" / run.training_run_id / "weights" / "keep" / "tinker_state.pt"
        assert src.stat().st_ino == dst.stat().st_ino  # storage shared: no bytes copied
        resumed = svc.create_training_client_from_state(copy).result()
        assert np.array_equal(logprobs(resumed), logprobs(tc))
        snap_copy = svc.copy_weights(snap).result()
        base = svc.create_sampling_client(model_path=snap_copy).result()
        lps = base.compute_logprobs(types.ModelInput.from_ints(IDS)).result()
        np.testing.assert_allclose(np.array(lps[1:], dtype=np.float32), logprobs(tc), atol=1e-4)
        owner = rest.get_session(run.training_run_id.rsplit(":train:", 1)[0]).result()
        assert owner.training_run_ids == [run.training_run_id]
    finally:
        svc.close("success").result()
