"""The event-file writer's bytes are the protobuf library's, and its file is one TensorBoard reads.

services/coordinator/tb_writer.py encodes Event, Summary and TensorProto by hand (the run venv has no
tensorboard package); here each record is compared with the same message built by TensorBoard's own protos
(installed with the dev extra), and the CRC with TensorBoard's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.coordinator.tb_writer import SummaryWriter, event_bytes, masked_crc32c, scalar_summary, text_summary

pytest.importorskip("tensorboard")
from tensorboard.compat.proto.event_pb2 import Event, SourceMetadata  # noqa: E402
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata  # noqa: E402
from tensorboard.compat.proto.tensor_pb2 import TensorProto  # noqa: E402
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto  # noqa: E402
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_crc  # noqa: E402
from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData  # noqa: E402
from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: E402


@pytest.mark.parametrize("data", [b"", b"a", b"brain.Event:2", bytes(range(256)) * 3])
def test_crc_is_tensorboards(data: bytes) -> None:
    assert masked_crc32c(data) == tb_crc(data)


@pytest.mark.parametrize("step", [None, 0, 1, 300, 2**40, -1])
@pytest.mark.parametrize("value", [0.0, 1.0, -1.25, 3e38, float("inf")])
def test_scalar_event_bytes(step: int | None, value: float) -> None:
    summary = Summary(value=[Summary.Value(tag="A/train/loss", simple_value=value)])
    event = Event(summary=summary, wall_time=1234.5)
    if step is not None:
        event.step = step
    assert event_bytes(1234.5, step, scalar_summary("A/train/loss", value)) == event.SerializeToString()


@pytest.mark.parametrize("text", ["", "**X** plays 5|\n\nwörld", "x" * 300])
def test_text_event_bytes(text: str) -> None:
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
    tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    summary = Summary(value=[Summary.Value(tag="transcripts/train/text_summary", metadata=meta, tensor=tensor)])
    event = Event(summary=summary, wall_time=99.0, step=2)
    assert event_bytes(99.0, 2, text_summary("transcripts/train", text)) == event.SerializeToString()


def test_file_is_what_event_file_writer_writes(tmp_path: Path) -> None:
    """The first record (file version, writer) and the framing match TensorBoard's EventFileWriter."""
    ours = SummaryWriter(str(tmp_path / "ours"))
    ours.add_scalar("s", 2.0, global_step=3)
    ours.close()
    theirs = EventFileWriter(str(tmp_path / "theirs"))
    theirs.add_event(Event(summary=Summary(value=[Summary.Value(tag="s", simple_value=2.0)]), wall_time=1.0, step=3))
    theirs.close()
    records = []
    for name in ("ours", "theirs"):
        (path,) = (tmp_path / name).iterdir()
        assert path.name.startswith("events.out.tfevents.")
        raw, events = path.read_bytes(), []
        while raw:
            n = int.from_bytes(raw[:8], "little")
            events.append(Event.FromString(raw[12:12 + n]))
            raw = raw[16 + n:]
        records.append(events)
    for events in records:
        events[0].wall_time = 0.0
        events[1].wall_time = 0.0
    assert records[0] == records[1]
    assert records[0][0].source_metadata == SourceMetadata(writer="tensorboard.summary.writer.event_file_writer")
