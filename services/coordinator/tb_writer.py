"""TensorBoard event files without torch: the scalars and texts the run logger writes (tracking.py).

``torch.utils.tensorboard.SummaryWriter`` imports torch (seconds), and the coordinator runs no model: only
engines and trainers import torch (docs/architecture.md §9, its start-up paragraph). This writer writes the
same records through TensorBoard's own event-file writer: a scalar as ``simple_value`` under its tag, a text
as a ``DT_STRING`` tensor with the text plugin's metadata under ``<tag>/text_summary``, as SummaryWriter's
``add_scalar`` and ``add_text`` do.
"""

from __future__ import annotations

import time

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class SummaryWriter:
    """The part of SummaryWriter's interface the run logger uses, writing to ``log_dir``."""

    def __init__(self, log_dir: str, flush_secs: int = 120, max_queue: int = 10) -> None:
        self.writer = EventFileWriter(log_dir, max_queue, flush_secs)

    def _add(self, summary: Summary, global_step: int | None) -> None:
        event = Event(summary=summary, wall_time=time.time())
        if global_step is not None:
            event.step = int(global_step)
        self.writer.add_event(event)

    def add_scalar(self, tag: str, value: float, global_step: int | None = None) -> None:
        self._add(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]), global_step)

    def add_text(self, tag: str, text: str, global_step: int | None = None) -> None:
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self._add(Summary(value=[Summary.Value(tag=f"{tag}/text_summary", metadata=meta, tensor=tensor)]),
                  global_step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
