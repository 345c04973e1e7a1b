"""TensorBoard event files without torch or the tensorboard package: the scalars and texts the run logger writes.

``torch.utils.tensorboard.SummaryWriter`` imports torch (seconds), and the coordinator runs no model: only
engines and trainers import torch (docs/architecture.md §9, its start-up paragraph). The tensorboard package
(with grpcio and its data server, about 55 MiB installed) is what *views* the files; writing them needs
neither. This writer encodes the few protobuf messages itself and frames them as TFRecords, as TensorBoard's
``EventFileWriter`` does: a scalar as ``simple_value`` under its tag, a text as a ``DT_STRING`` tensor with
the text plugin's metadata under ``<tag>/text_summary``, as SummaryWriter's ``add_scalar`` and ``add_text``
do. tests/unit/test_torch_free_start.py reads both writers' files with TensorBoard's reader and compares them;
tests/unit/test_tb_writer.py compares each record's bytes with the protobuf library's.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time

_UIDS = itertools.count()  # EventFileWriter's _global_uid: two writers in one process name two files
_FILE_VERSION = b"brain.Event:2"
_SOURCE = b"tensorboard.summary.writer.event_file_writer"
_DT_STRING = 7  # tensorflow.DataType


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C (Castagnoli), rotated right by 15 bits plus a constant."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tf_record(data: bytes) -> bytes:
    """One record: its length (uint64), the length's masked CRC, the data, the data's masked CRC."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


# --- protobuf wire format: only the field kinds these messages use ------------------------------------------
def _varint(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # a negative int64 is its two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _int(field: int, n: int) -> bytes:
    return _varint(field << 3) + _varint(n)


def _bytes(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _double(field: int, x: float) -> bytes:
    return _varint(field << 3 | 1) + struct.pack("<d", x)


def _float(field: int, x: float) -> bytes:
    return _varint(field << 3 | 5) + struct.pack("<f", x)


def event_bytes(wall_time: float, step: int | None, summary: bytes | None = None) -> bytes:
    """``tensorflow.Event``: wall_time (1), step (2), summary (5); proto3 leaves zeros out."""
    out = _double(1, wall_time) if wall_time else b""
    if step:
        out += _int(2, int(step))
    return out + (_bytes(5, summary) if summary is not None else b"")


def scalar_summary(tag: str, value: float) -> bytes:
    """``Summary`` with one ``Value``: tag (1), simple_value (2, a oneof member: written even when 0)."""
    return _bytes(1, _bytes(1, tag.encode("utf-8")) + _float(2, value))


def text_summary(tag: str, text: str) -> bytes:
    """``Summary`` with one ``Value``: tag (1), a one-element DT_STRING tensor (8), the text plugin's metadata (9).

    The plugin's content (``TextPluginData(version=0)``) serializes to nothing, so only its name is written."""
    shape = _bytes(2, _int(1, 1))  # TensorShapeProto.dim (2): Dim.size (1) = 1
    tensor = _int(1, _DT_STRING) + _bytes(2, shape) + _bytes(8, text.encode("utf-8"))
    metadata = _bytes(1, _bytes(1, b"text"))  # SummaryMetadata.plugin_data (1): PluginData.plugin_name (1)
    value = _bytes(1, f"{tag}/text_summary".encode()) + _bytes(8, tensor) + _bytes(9, metadata)
    return _bytes(1, value)


class SummaryWriter:
    """The part of SummaryWriter's interface the run logger uses, writing one event file in ``log_dir``.

    Records are buffered and written out by ``flush`` (the run logger calls it after each pass), by ``close``,
    and by any write ``flush_secs`` after the last flush. ``max_queue`` is accepted for the same signature."""

    def __init__(self, log_dir: str, flush_secs: int = 120, max_queue: int = 10) -> None:
        os.makedirs(log_dir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_UIDS)}"
        self.path = os.path.join(log_dir, name)
        self.flush_secs = flush_secs
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        first = _double(1, time.time()) + _bytes(3, _FILE_VERSION) + _bytes(10, _bytes(1, _SOURCE))
        self._file.write(tf_record(first))
        self.flush()

    def _add(self, summary: bytes, global_step: int | None) -> None:
        self._file.write(tf_record(event_bytes(time.time(), global_step, summary)))
        if time.monotonic() - self._flushed >= self.flush_secs:
            self.flush()

    def add_scalar(self, tag: str, value: float, global_step: int | None = None) -> None:
        self._add(scalar_summary(tag, float(value)), global_step)

    def add_text(self, tag: str, text: str, global_step: int | None = None) -> None:
        self._add(text_summary(tag, text), global_step)

    def flush(self) -> None:
        self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
