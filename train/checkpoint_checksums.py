"""A CRC-32 on every record of a sharded checkpoint: computed while the save writes it, checked while the load reads it.

torch.distributed.checkpoint (DCP) writes each tensor as one record of a rank's `__<rank>_0.distcp` file (a
`torch.save` archive at an offset that `.metadata` keeps) and reads it back with `torch.load`, which does not
check the archive's CRCs: bytes overwritten inside a record load as wrong weights, without a word. DCP has no
checksum setting; its place for a transform of each record's bytes is the stream-transform extension
(`FileSystemWriter(_extensions=...)` / `FileSystemReader(_extension_registry=...)`, marked experimental, the same
hook its zstd compression uses), so the checksum is one:

- `Crc32Trailer` appends to each record its length and CRC-32 (12 bytes) while DCP writes it, and checks both
  before `torch.load` sees the bytes, raising `DamagedRecord` (the file and the record's offset) on a mismatch.
  DCP names the extension in `.metadata` for every record it wrapped, so a checkpoint written without it (by
  plain `dcp.save`) still loads, unchecked.
- `truncated_or_missing(directory)`: the damage a directory listing shows without reading any record (a shard
  file gone, or shorter than its records reach), from `.metadata` alone.
- `save` / `load`: `dcp.save` / `dcp.load` with the extension, DCP's failure wrapper (`CheckpointException`, a
  `BaseException` carrying every rank's traceback) replaced by the first rank's own exception.

The check costs one pass of `zlib.crc32` over bytes already in memory (no second read of the files).
"""

import io
import pickle
import struct
import zlib
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["Crc32Trailer", "DamagedRecord", "load", "save", "truncated_or_missing"]

TRAILER = struct.Struct("<QI")  # the record's length in bytes and its CRC-32, both checked


class DamagedRecord(Exception):
    """A record whose bytes are not the ones written (its CRC-32 or length differs)."""

    def __init__(self, file: str, offset: int | None, why: str):
        self.file, self.offset, self.why = file, offset, why
        where = f"the record at byte {offset:,}" if offset is not None else "a record"
        super().__init__(f"{where} of {Path(file).name} {why}")

    def __reduce__(self):  # DCP pickles a rank's failure to send it to every rank
        return DamagedRecord, (self.file, self.offset, self.why)


class _ChecksumWriter(io.RawIOBase):
    """Passes every write to `output`, keeping the running CRC-32; `close` appends the trailer."""

    def __init__(self, output):
        super().__init__()
        self.output, self.crc, self.length = output, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.length += len(view)
        self.output.write(view)
        return len(view)

    def close(self) -> None:
        if not self.closed:  # DCP closes each record's stream once, after the record is complete
            self.output.write(TRAILER.pack(self.length, self.crc))
            self.output.close()  # DCP's wrapper: flushes, leaves the shard file open for the next record
        super().close()


class Crc32Trailer(StreamTransformExtension):
    """DCP stream-transform extension: each record followed by its length and CRC-32, checked on load."""

    @staticmethod
    def registry_name() -> str:
        return "overlap_zoo.crc32"

    @staticmethod
    def from_descriptor(version: str) -> "Crc32Trailer":
        if version != "1":
            raise ValueError(f"{Crc32Trailer.registry_name()} version {version!r} is not known here (only 1)")
        return Crc32Trailer()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        return _ChecksumWriter(output)

    def transform_from(self, input):
        # DCP hands a view of the shard file bounded by the record's offset and length (trailer included).
        file = getattr(getattr(input, "base_stream", None), "name", "a shard file")
        offset = getattr(input, "offset", None)
        data = input.read()
        if len(data) < TRAILER.size:
            raise DamagedRecord(file, offset, f"is cut short ({len(data)} bytes; the file was truncated)")
        payload = memoryview(data)[: -TRAILER.size]
        length, crc = TRAILER.unpack(data[-TRAILER.size :])
        if length != len(payload) or zlib.crc32(payload) != crc:
            raise DamagedRecord(file, offset, "fails its CRC-32 check (its bytes changed after they were written)")
        return io.BytesIO(payload)  # seekable: torch.load reads it in place


def _registry() -> ExtensionRegistry:
    registry = ExtensionRegistry()
    registry.register(Crc32Trailer)
    return registry


def _first_failure(error: CheckpointException) -> BaseException:
    """The exception one rank raised inside DCP (the lowest rank's), unwrapped."""
    exception, _ = error.failures[min(error.failures)]
    return exception


def save(state: dict, directory: str | Path) -> None:
    """`dcp.save(state)` into `directory`, every record with its CRC-32 (collective under torch.distributed).
    A rank's failure is raised on every rank as that rank's own exception (an OSError for a full disk)."""
    writer = FileSystemWriter(directory, _extensions=[Crc32Trailer()])
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException as error:
        raise _first_failure(error) from None


def load(state: dict, directory: str | Path, **kwargs) -> None:
    """`dcp.load(state)` from `directory` (`kwargs`: planner, no_dist), checking every record that carries a
    CRC-32. A damaged record raises `DamagedRecord` on every rank; any other failure its own exception."""
    reader = FileSystemReader(directory, _extension_registry=_registry())
    try:
        dcp.load(state, storage_reader=reader, **kwargs)
    except CheckpointException as error:
        failures = [exception for exception, _ in error.failures.values()]
        damaged = [f for f in failures if isinstance(f, DamagedRecord)]
        raise (damaged[0] if damaged else _first_failure(error)) from None


def truncated_or_missing(directory: str | Path) -> str | None:
    """What `.metadata` shows is wrong with `directory`'s shard files without reading them (a file missing, or
    shorter than its records reach), in words; None if every file is there at its full length."""
    directory = Path(directory)
    try:
        with open(directory / ".metadata", "rb") as file:
            metadata = pickle.load(file)
        reach: dict[str, int] = {}
        for info in metadata.storage_data.values():
            reach[info.relative_path] = max(reach.get(info.relative_path, 0), info.offset + info.length)
    except Exception as error:  # unreadable in any way: the same to the user
        return f".metadata cannot be read ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no details'})"
    for name, needed in sorted(reach.items()):
        path = directory / name
        if not path.is_file():
            return f"its shard file {name} is missing"
        size = path.stat().st_size
        if size < needed:
            return f"its shard file {name} is cut short ({size:,} bytes; its records reach byte {needed:,})"
    return None
