"""rosbag2 reading and writing without rosbag2_py (through `rosbags`), with our message types.

- `typestore()`: a rosbags typestore for ROS 2 Kilted plus the photon_ros messages, parsed
  from the .msg files (the checkout's msg/ or the installed share/photon_ros/msg).
- `BagReader`: opens a rosbag2 bag (a folder with metadata.yaml, or a bare .mcap / .db3
  file; mcap and sqlite3 storage) and yields raw messages in time order. Every failure
  (missing, corrupt, truncated, unknown storage) is raised as `BagError` with the bag path
  and how far reading got, never as a bare library traceback.
- `BagWriter`: writes CDR bytes (or rclpy messages, serialized with rclpy) into a new bag,
  mcap by default. Connections carry the full message definition, so `ros2 bag play` and
  Foxglove decode our custom types. Used as a context manager it always closes the bag
  (metadata.yaml written), so an error later in a replay keeps the results already written.

Imports rosbags only; rclpy is imported on first use of an rclpy message.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator

IMAGE = "sensor_msgs/msg/Image"
COMPRESSED_IMAGE = "sensor_msgs/msg/CompressedImage"
CAMERA_TYPES = (IMAGE, COMPRESSED_IMAGE)
CLOCK = "rosgraph_msgs/msg/Clock"
PACKAGE = "photon_ros"
RESULT_TYPES = ("photon_ros/msg/DetectionArray", "photon_ros/msg/PointArray",
                "photon_ros/msg/Answer")
STORAGES = ("mcap", "sqlite3")


class BagError(ValueError):
    """A bag that cannot be read or written as asked; the message says which and why."""


# -- types -----------------------------------------------------------------------------
def msg_dirs() -> list[Path]:
    """Where photon_ros .msg files may be: the checkout, the venv/prefix, AMENT_PREFIX_PATH."""
    cands = [Path(__file__).resolve().parent.parent / "msg",
             Path(sys.prefix) / "share" / PACKAGE / "msg"]
    for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        if prefix:
            cands.append(Path(prefix) / "share" / PACKAGE / "msg")
    return [p for p in cands if p.is_dir() and any(p.glob("*.msg"))]


def our_type_texts() -> dict[str, str]:
    """{"photon_ros/msg/Name": msg text} from the first msg folder found."""
    dirs = msg_dirs()
    if not dirs:
        raise BagError("photon_ros .msg files not found (looked in the checkout's msg/, "
                       f"{sys.prefix}/share/{PACKAGE}/msg and AMENT_PREFIX_PATH)")
    return {f"{PACKAGE}/msg/{p.stem}": p.read_text() for p in sorted(dirs[0].glob("*.msg"))}


@lru_cache(maxsize=1)
def typestore():
    """rosbags typestore: ROS 2 Kilted standard types + photon_ros messages."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(getattr(Stores, "ROS2_KILTED", Stores.LATEST))
    types: dict = {}
    for name, text in our_type_texts().items():
        types.update(get_types_from_msg(text, name))
    store.register(types)
    return store


def rclpy_type(msgtype: str):
    """The rclpy message class of "pkg/msg/Name"."""
    import importlib

    pkg, _, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{pkg}.msg"), name)


def msgtype_of(msg: Any) -> str:
    """"pkg/msg/Name" of an rclpy message instance."""
    mod = type(msg).__module__.split(".")
    return f"{mod[0]}/msg/{type(msg).__name__}"


def serialize(msg: Any) -> bytes:
    from rclpy.serialization import serialize_message

    return serialize_message(msg)


def deserialize(raw: bytes, msgtype: str):
    """raw CDR -> rclpy message."""
    from rclpy.serialization import deserialize_message

    return deserialize_message(bytes(raw), rclpy_type(msgtype))


def stamp_ns(header: Any) -> int:
    """Header stamp (rclpy or rosbags message) in nanoseconds."""
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


# -- reading ---------------------------------------------------------------------------
@dataclass
class _Conn:
    id: int
    topic: str
    msgtype: str
    msgcount: int = 0


class McapSalvageReader:
    """Sequential reader for an .mcap file without a valid summary/footer: what a recorder
    that died (or a copy that was cut short) leaves behind. Reads records in file order and
    stops with ReaderError-like `BagError` at the first damaged or missing byte; every
    message before that point is yielded. Chunks may be uncompressed, zstd or lz4."""

    MAGIC = b"\x89MCAP0\r\n"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.connections: list[_Conn] = []
        self.damage: str | None = None
        self.message_count = 0
        self.start_time = 0

    def open(self) -> None:
        by_id: dict[int, _Conn] = {}
        first = None
        try:
            for cid, t, _raw in self._records(by_id, want=None):
                by_id[cid].msgcount += 1
                self.message_count += 1
                first = t if first is None else min(first, t)
        except BagError as e:
            self.damage = str(e)
        self.connections = list(by_id.values())
        self.start_time = first or 0

    def close(self) -> None:
        pass

    def messages(self, connections=None):
        ids = None if connections is None else {c.id for c in connections}
        by_id: dict[int, _Conn] = {}
        for cid, t, raw in self._records(by_id, want=ids):
            yield by_id[cid], t, raw

    def _records(self, by_id: dict, want):
        import struct

        from rosbags.rosbag2.storage_mcap import decompress

        schemas: dict[int, str] = {}
        with open(self.path, "rb") as f:
            if f.read(8) != self.MAGIC:
                raise BagError("not an MCAP file (bad magic)")

            def take(bio, n: int, where: str) -> bytes:
                b = bio.read(n)
                if len(b) != n:
                    raise BagError(f"file ends inside {where} (truncated)")
                return b

            def string(bio, where):
                (n,) = struct.unpack("<I", take(bio, 4, where))
                return take(bio, n, where).decode()

            def records(bio, top: bool):
                while True:
                    op = bio.read(1)
                    if not op:
                        if top:
                            raise BagError("file ends without a footer (truncated)")
                        return
                    (size,) = struct.unpack("<Q", take(bio, 8, "a record header"))
                    if size > (1 << 40):
                        raise BagError(f"record length {size} is implausible (corrupt)")
                    yield op[0], take(bio, size, f"a record (op 0x{op[0]:02x})")

            import io

            def handle(op, body):
                rec = io.BytesIO(body)
                if op == 0x03:
                    (sid,) = struct.unpack("<H", take(rec, 2, "schema"))
                    schemas[sid] = string(rec, "schema")
                elif op == 0x04:
                    cid, sid = struct.unpack("<HH", take(rec, 4, "channel"))
                    topic = string(rec, "channel")
                    if cid not in by_id:
                        by_id[cid] = _Conn(cid, topic, schemas.get(sid, "__schemaless__"))
                elif op == 0x05:
                    cid, _seq, log_time, _pub = struct.unpack("<HIQQ", take(rec, 22, "message"))
                    if cid not in by_id:
                        raise BagError(f"message on unknown channel {cid} (corrupt)")
                    if want is None or cid in want:
                        return [(cid, log_time, body[22:])]
                return []

            for op, body in records(f, top=True):
                if op == 0x02:                       # footer: the file is complete after all
                    return
                if op == 0x06:
                    rec = io.BytesIO(body)
                    _s, _e, usize, crc = struct.unpack("<QQQI", take(rec, 28, "chunk"))
                    comp = string(rec, "chunk")
                    (csize,) = struct.unpack("<Q", take(rec, 8, "chunk"))
                    try:
                        data = decompress(take(rec, csize, "chunk"), comp, usize, crc)
                    except BagError:
                        raise
                    except Exception as e:  # noqa: BLE001
                        raise BagError(f"damaged chunk: {e}") from e
                    out = []
                    for op2, body2 in records(io.BytesIO(data), top=False):
                        out += handle(op2, body2)
                    yield from sorted(out, key=lambda x: x[1])
                else:
                    yield from handle(op, body)


@dataclass(frozen=True)
class BagMessage:
    topic: str
    msgtype: str
    log_time_ns: int         # when the recorder received it (bag time)
    raw: bytes               # CDR
    index: int               # position in the bag's time order (0-based)


class BagReader:
    """Read a rosbag2 bag (mcap or sqlite3) with clear errors. Use as a context manager."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._reader = None
        self.read = 0            # messages yielded so far
        self.last_time_ns: int | None = None
        self.warning: str | None = None   # set when the bag is damaged but partly readable

    def __enter__(self) -> "BagReader":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        from rosbags.rosbag2 import Reader

        if not self.path.exists():
            raise BagError(f"bag {str(self.path)!r} does not exist")
        if self.path.is_dir() and not (self.path / "metadata.yaml").exists():
            files = sorted(self.path.glob("*.mcap")) + sorted(self.path.glob("*.db3"))
            if len(files) == 1:          # a bag folder whose recorder died before metadata
                self.path = files[0]
            else:
                raise BagError(f"bag folder {str(self.path)!r} has no metadata.yaml and "
                               f"{len(files)} storage files; pass one .mcap/.db3 file")
        try:
            self._reader = Reader(self.path)
            self._reader.open()
        except Exception as e:  # noqa: BLE001 - rosbags raises many kinds; one clear error
            self._reader = None
            why = f"{type(e).__name__}: {e}"
            mcap = self._mcap_file()
            if mcap is not None:                 # no valid footer/index: read what is there
                salvage = McapSalvageReader(mcap)
                try:
                    salvage.open()
                except BagError as e2:
                    raise BagError(f"cannot open bag {str(self.path)!r}: {why}; "
                                   f"sequential read failed too: {e2}") from e
                if salvage.message_count:
                    self._reader = salvage
                    self.warning = (f"bag {str(self.path)!r} is damaged ({why}); reading it "
                                    f"sequentially: {salvage.message_count} messages readable"
                                    + (f", then: {salvage.damage}" if salvage.damage else ""))
                    return
            raise BagError(f"cannot open bag {str(self.path)!r}: {why}") from e

    def _mcap_file(self) -> Path | None:
        if self.path.is_file() and self.path.suffix == ".mcap":
            return self.path
        if self.path.is_dir():
            files = sorted(self.path.glob("*.mcap"))
            if len(files) == 1:
                return files[0]
        return None

    def close(self) -> None:
        if self._reader is not None:
            try:
                self._reader.close()
            except Exception:  # noqa: BLE001
                pass
            self._reader = None

    @property
    def topics(self) -> dict[str, str]:
        """{topic: msgtype}"""
        return {c.topic: c.msgtype for c in self._reader.connections}

    @property
    def message_count(self) -> int:
        return int(self._reader.message_count)

    @property
    def salvaged(self) -> bool:
        return isinstance(self._reader, McapSalvageReader)

    def topic_count(self, topics: Iterable[str]) -> int:
        want = set(topics)
        return sum(c.msgcount for c in self._reader.connections if c.topic in want)

    @property
    def start_time_ns(self) -> int:
        return int(self._reader.start_time)

    @property
    def storage(self) -> str:
        p = self.path
        if p.suffix == ".db3" or (p.is_dir() and any(p.glob("*.db3"))):
            return "sqlite3"
        return "mcap"

    def messages(self, topics: Iterable[str] | None = None) -> Iterator[BagMessage]:
        """Messages of `topics` (all when None) in time order. A read failure part-way
        raises BagError saying how many messages were read before it."""
        want = None if topics is None else set(topics)
        conns = [c for c in self._reader.connections if want is None or c.topic in want]
        if not conns:
            return
        it = self._reader.messages(connections=conns)
        while True:
            try:
                conn, t, raw = next(it)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001
                at = "" if self.last_time_ns is None else f", last good message at " \
                     f"{self.last_time_ns / 1e9:.3f} s"
                raise BagError(f"bag {str(self.path)!r} is corrupt or truncated: reading failed "
                               f"after {self.read} messages{at}: {type(e).__name__}: {e}") from e
            msg = BagMessage(conn.topic, conn.msgtype, int(t), bytes(raw), self.read)
            self.read += 1
            self.last_time_ns = int(t)
            yield msg


def read_all(path, topics=None) -> list[BagMessage]:
    with BagReader(path) as r:
        return list(r.messages(topics))


# -- writing ---------------------------------------------------------------------------
class BagWriter:
    """Write a new rosbag2 bag. `write(topic, msg, t_ns)` takes an rclpy message;
    `write_raw(topic, msgtype, raw, t_ns)` CDR bytes. Always close (context manager)."""

    def __init__(self, path: str | os.PathLike, storage: str = "mcap", overwrite: bool = False):
        from rosbags.rosbag2 import StoragePlugin, Writer

        if storage not in STORAGES:
            raise BagError(f"storage must be one of {STORAGES}, got {storage!r}")
        self.path = Path(path)
        if self.path.exists():
            if not overwrite:
                raise BagError(f"output bag {str(self.path)!r} exists (use --overwrite)")
            if self.path.is_dir():
                shutil.rmtree(self.path)
            else:
                self.path.unlink()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        plugin = StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3
        self._writer = Writer(self.path, version=9, storage_plugin=plugin)
        self.storage = storage
        self._conns: dict[tuple[str, str], Any] = {}
        self.count = 0
        self.per_topic: dict[str, int] = {}
        self._open = False

    def __enter__(self) -> "BagWriter":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        self._writer.open()
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._writer.close()

    def _conn(self, topic: str, msgtype: str):
        key = (topic, msgtype)
        conn = self._conns.get(key)
        if conn is None:
            if any(t == topic for t, _ in self._conns):
                raise BagError(f"topic {topic!r} already written with another type")
            store = typestore()
            if msgtype not in store.types:
                raise BagError(f"unknown message type {msgtype!r}")
            conn = self._writer.add_connection(topic, msgtype, typestore=store)
            self._conns[key] = conn
        return conn

    def write_raw(self, topic: str, msgtype: str, raw: bytes, t_ns: int) -> None:
        self._writer.write(self._conn(topic, msgtype), int(t_ns), raw)
        self.count += 1
        self.per_topic[topic] = self.per_topic.get(topic, 0) + 1

    def write(self, topic: str, msg: Any, t_ns: int) -> None:
        """Write an rclpy message as canonical CDR (see `canonical_cdr`)."""
        t = msgtype_of(msg)
        self.write_raw(topic, t, canonical_cdr(serialize(msg), t), t_ns)


def canonical_cdr(raw: bytes, msgtype: str) -> bytes:
    """The same message with zeroed alignment padding. rclpy leaves whatever was in memory
    in CDR padding bytes, so its output is not byte-for-byte reproducible; rosbags writes
    zeros. Round-tripping through the rosbags typestore gives reproducible bytes."""
    return encode(decode(raw, msgtype), msgtype)


def decode(raw: bytes, msgtype: str):
    """CDR -> rosbags dataclass (no rclpy needed)."""
    return typestore().deserialize_cdr(raw, msgtype)


def encode(msg: Any, msgtype: str) -> bytes:
    """rosbags dataclass -> CDR."""
    return bytes(typestore().serialize_cdr(msg, msgtype))
