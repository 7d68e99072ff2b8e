"""rosbag2 I/O through rosbags: round trips in mcap and sqlite3, type definitions that other
tools can decode, the sample bag, and clear errors on damaged or unusual bags."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import interface_samples as S  # noqa: E402
from photon_ros import bag_io  # noqa: E402
from photon_ros.bag_io import (BagError, BagReader, BagWriter, decode, deserialize,  # noqa: E402
                               msgtype_of, read_all)
from photon_ros.sample_bag import make_sample_bag  # noqa: E402


def _same(a, b) -> bool:
    """rclpy message equality with NaN == NaN (Moondream scores are NaN)."""
    if type(a) is not type(b):
        return False
    if hasattr(a, "get_fields_and_field_types"):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.get_fields_and_field_types())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def _samples():
    return [S.detection_array(i) if i % 3 == 0 else S.point_array(i) if i % 3 == 1 else S.answer(i)
            for i in range(9)]


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_round_trip_result_messages(tmp_path, storage):
    msgs = _samples()
    with BagWriter(tmp_path / "b", storage=storage) as w:
        for i, m in enumerate(msgs):
            w.write(f"/front/{msgtype_of(m).split('/')[-1].lower()}", m, 1_000 + i)
    ext = ".mcap" if storage == "mcap" else ".db3"
    assert (tmp_path / "b" / "metadata.yaml").is_file()
    assert (tmp_path / "b" / f"b{ext}").is_file()
    back = read_all(tmp_path / "b")
    assert [b.log_time_ns for b in back] == [1_000 + i for i in range(9)]
    for m, b in zip(msgs, back):
        assert b.msgtype == msgtype_of(m)
        assert _same(deserialize(b.raw, b.msgtype), m)          # rclpy decodes it
        r = decode(b.raw, b.msgtype)                            # rosbags decodes it too
        assert r.camera == m.camera and r.header.stamp.sec == m.header.stamp.sec
    # bare storage file opens as well
    assert len(read_all(tmp_path / "b" / f"b{ext}")) == 9


def test_connections_carry_definitions_and_ros_type_hashes(tmp_path):
    """ros2 bag / Foxglove decode by the definition in the bag: it must be the full .msg text
    (with nested types), and the type hash must be the one rosidl generated."""
    with BagWriter(tmp_path / "b") as w:
        w.write("/front/detections", S.detection_array(), 1)
    with BagReader(tmp_path / "b") as r:
        conn = r._reader.connections[0]
    assert "TaskInfo task" in conn.msgdef.data and "MSG: photon_ros/TaskInfo" in conn.msgdef.data
    assert "MSG: std_msgs/Header" in conn.msgdef.data
    meta = (tmp_path / "b" / "metadata.yaml").read_text()
    share = Path(sys.prefix) / "share" / "photon_ros" / "msg" / "DetectionArray.json"
    if share.is_file():
        want = json.loads(share.read_text())["type_hashes"][0]["hash_string"]
        assert want in meta


def test_written_bytes_are_reproducible(tmp_path):
    """rclpy leaves garbage in CDR padding; the writer canonicalizes it."""
    raws = []
    for k in range(2):
        with BagWriter(tmp_path / f"run{k}" / "b") as w:
            for i, m in enumerate(_samples()):
                w.write("/x/" + msgtype_of(m).split("/")[-1], m, i)
        raws.append([b.raw for b in read_all(tmp_path / f"run{k}" / "b")])
    assert raws[0] == raws[1]
    assert (tmp_path / "run0" / "b" / "b.mcap").read_bytes() == \
        (tmp_path / "run1" / "b" / "b.mcap").read_bytes()


@pytest.mark.parametrize("storage,compressed", [("mcap", False), ("sqlite3", True)])
def test_sample_bag(tmp_path, storage, compressed):
    from photon_ros.image_conversion import compressed_to_rgb, image_to_rgb

    info = make_sample_bag(tmp_path / "s", seconds=1.0, fps=4, storage=storage,
                           compressed=compressed, topics=["/front/image_raw", "/rear/image_raw"])
    assert info["frames"] == 4 and info["messages"] == 8
    msgs = read_all(tmp_path / "s")
    assert [m.topic for m in msgs[:2]] == ["/front/image_raw", "/rear/image_raw"]
    first = deserialize(msgs[0].raw, msgs[0].msgtype)
    rgb = compressed_to_rgb(first) if compressed else image_to_rgb(first)
    assert rgb.shape == (480, 640, 3) and rgb.std() > 10
    assert first.header.stamp.sec == 1_700_000_000
    # deterministic, and the scene moves
    again = make_sample_bag(tmp_path / "s2", seconds=1.0, fps=4, storage=storage,
                            compressed=compressed, topics=["/front/image_raw", "/rear/image_raw"])
    assert again["messages"] == 8
    assert [m.raw for m in read_all(tmp_path / "s2")] == [m.raw for m in msgs]
    assert msgs[0].raw != msgs[2].raw


def test_missing_and_non_bag_paths(tmp_path):
    with pytest.raises(BagError, match="does not exist"):
        BagReader(tmp_path / "nope").open()
    (tmp_path / "empty").mkdir()
    with pytest.raises(BagError, match="no metadata.yaml"):
        BagReader(tmp_path / "empty").open()
    junk = tmp_path / "junk.mcap"
    junk.write_bytes(b"this is not a bag" * 10)
    with pytest.raises(BagError, match="cannot open bag"):
        BagReader(junk).open()


def test_writer_refuses_to_overwrite(tmp_path):
    with BagWriter(tmp_path / "b") as w:
        w.write("/a/answer", S.answer(), 1)
    with pytest.raises(BagError, match="exists"):
        BagWriter(tmp_path / "b")
    with BagWriter(tmp_path / "b", overwrite=True) as w:
        w.write("/a/answer", S.answer(), 2)
    assert [m.log_time_ns for m in read_all(tmp_path / "b")] == [2]


def _truncate(bag: Path, frac: float) -> Path:
    f = next(p for p in bag.iterdir() if p.suffix in (".mcap", ".db3"))
    os.truncate(f, int(f.stat().st_size * frac))
    return f


def test_truncated_mcap_is_read_up_to_the_damage(tmp_path):
    make_sample_bag(tmp_path / "t", seconds=2.0, fps=5, width=320, height=240)
    _truncate(tmp_path / "t", 0.6)
    with BagReader(tmp_path / "t") as r:
        assert r.salvaged and "damaged" in r.warning
        assert r.topics == {"/camera/image_raw": bag_io.IMAGE}
        got = []
        with pytest.raises(BagError, match="corrupt or truncated: reading failed after"):
            for m in r.messages():
                got.append(m)
    assert 3 <= len(got) < 10
    stamps = [deserialize(m.raw, m.msgtype).header.stamp.nanosec for m in got]
    assert stamps == sorted(stamps)
    for m in got:                                  # every yielded message is whole
        assert len(deserialize(m.raw, m.msgtype).data) == 320 * 240 * 3


def test_truncated_sqlite3_is_a_clear_error(tmp_path):
    make_sample_bag(tmp_path / "t", seconds=1.0, fps=5, width=320, height=240, storage="sqlite3")
    _truncate(tmp_path / "t", 0.5)
    with pytest.raises(BagError, match=r"cannot open bag .*malformed"):
        BagReader(tmp_path / "t").open()


def test_unknown_types_are_listed_not_decoded(tmp_path):
    """A topic of a type nobody here knows is still listed (its definition travels in the bag),
    and reading other topics is unaffected."""
    from rosbags.rosbag2 import StoragePlugin, Writer

    msgdef = "string who\nuint32 count\n"
    with Writer(tmp_path / "u", version=9, storage_plugin=StoragePlugin.MCAP) as w:
        c = w.add_connection("/acme/thing", "acme_msgs/msg/Thing", msgdef=msgdef,
                             rihs01="RIHS01_" + "0" * 64)
        w.write(c, 5, b"\x00\x01\x00\x00" + b"\x04\x00\x00\x00abc\x00" + b"\x07\x00\x00\x00")
    with BagReader(tmp_path / "u") as r:
        assert r.topics == {"/acme/thing": "acme_msgs/msg/Thing"}
        assert len(list(r.messages())) == 1
    with pytest.raises(ImportError):
        deserialize(b"", "acme_msgs/msg/Thing")
