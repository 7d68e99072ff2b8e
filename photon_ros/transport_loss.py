"""Frames a camera's publishers sent that never reached the node's image callback.

Two sources, both per camera subscription:

- The publication sequence number of every message taken (rclpy's MessageInfo: the DDS
  writer's sequence number, +1 per publish, per publisher gid). A gap between two frames
  taken from the same publisher is a frame lost anywhere between that publisher and the
  callback: in transport, dropped from the publisher's keep-last history before it was
  delivered, or overwritten in the subscription's own keep-last queue while the node's
  callbacks were behind. The last one is the common case on a busy node (reliable QoS) and
  the rmw does not report it (rmw_fastrtps_cpp, Kilted: checked in docs/reliability.md).
  Frames lost before the first or after the last frame taken from a publisher are not seen.
- The rmw's `message_lost` event (QoSMessageLostInfo.total_count_change): what the DDS reader
  itself saw missing (RTPS sequence gaps: best-effort transport losses, samples a reliable
  publisher dropped before delivering them). A subset of the gaps above, except that it also
  sees frames after the last one taken.

`lost` is the larger of the two totals: a lower bound of the frames lost, never a double count.
Counting by seen/highest sequence numbers (not consecutive differences) keeps a frame taken
late (reordered) from being counted as lost. A frame delivered twice (the same publisher and
sequence number among the last DUP_WINDOW taken, e.g. two transports to one reader) is counted
in `transport.duplicates` and not as seen: counted as seen it would hide a lost frame.
"""
from __future__ import annotations

import collections
import threading

# rmw_message_info_t's RMW_MESSAGE_INFO_SEQUENCE_NUMBER_UNSUPPORTED (UINT64_MAX)
_SEQ_UNSUPPORTED = 2 ** 64 - 1
MAX_PUBLISHERS = 16          # publishers remembered per camera (a restarted one gets a new gid)
WARN_FRACTION = 0.05         # WARN when lost > 5 % of received over the window ...
WARN_MIN_LOST = 2            # ... and at least this many frames were lost in it
DUP_WINDOW = 1024            # sequence numbers per publisher remembered to spot a duplicate


class _Publisher:
    __slots__ = ("first", "highest", "seen", "recent")

    def __init__(self, seq: int):
        self.first = self.highest = seq
        self.seen = 1
        self.recent = {seq}          # taken sequence numbers above highest - DUP_WINDOW (or more)

    def take(self, seq: int) -> bool:
        """Count a frame taken; False (nothing counted) for a duplicate of a recent one.
        (A frame older than the window is taken as a late one: it cannot be told apart.)"""
        if seq in self.recent:
            return False
        self.recent.add(seq)
        if seq < self.first:                  # reordered ahead of the first one seen
            self.first = seq
        if seq > self.highest:
            self.highest = seq
            if len(self.recent) > 2 * DUP_WINDOW:      # amortized: keep the newest window
                low = self.highest - DUP_WINDOW
                self.recent = {s for s in self.recent if s > low}
        self.seen += 1
        return True

    def missing(self) -> int:
        return max(0, self.highest - self.first + 1 - self.seen)


class TransportLoss:
    def __init__(self, window_events: int = 4096):
        self.lock = threading.Lock()
        self.pubs: collections.OrderedDict = collections.OrderedDict()   # gid -> _Publisher
        self.gaps_retired = 0            # missing frames of publishers forgotten (LRU)
        self.rmw_lost = 0                # sum of message_lost total_count_change
        self.no_sequence = 0             # messages without a usable sequence number / gid
        self.duplicates = 0              # a frame taken twice (same publisher and sequence)
        self.gap_events: collections.deque = collections.deque(maxlen=window_events)  # (t, n)
        self.rmw_events: collections.deque = collections.deque(maxlen=window_events)  # (t, n)

    # -- inputs ------------------------------------------------------------------------------
    def on_message(self, info, t: float) -> int:
        """One message taken (info: rclpy MessageInfo dict or None). Returns the change of the
        sequence-gap count (negative when a frame counted missing arrived late)."""
        seq = info.get("publication_sequence_number") if isinstance(info, dict) else None
        gid = info.get("publisher_gid") if isinstance(info, dict) else None
        key = gid.get("data") if isinstance(gid, dict) else None
        if not isinstance(seq, int) or seq <= 0 or seq >= _SEQ_UNSUPPORTED or key is None:
            with self.lock:
                self.no_sequence += 1
            return 0
        key = bytes(key)
        with self.lock:
            p = self.pubs.get(key)
            if p is None:
                self.pubs[key] = _Publisher(seq)
                while len(self.pubs) > MAX_PUBLISHERS:
                    self.gaps_retired += self.pubs.popitem(last=False)[1].missing()
                return 0
            self.pubs.move_to_end(key)
            before = p.missing()
            if not p.take(seq):
                self.duplicates += 1
                return 0
            delta = p.missing() - before
            if delta:
                self.gap_events.append((t, delta))
            return delta

    def on_rmw_lost(self, change: int, t: float) -> None:
        """The rmw's message_lost event (total_count_change)."""
        if change > 0:
            with self.lock:
                self.rmw_lost += change
                self.rmw_events.append((t, change))

    def restart(self) -> None:
        """A new subscription (activate, topic changed): sequences start afresh; what was
        counted stays counted."""
        with self.lock:
            self.gaps_retired += sum(p.missing() for p in self.pubs.values())
            self.pubs.clear()

    # -- outputs -----------------------------------------------------------------------------
    def totals(self) -> dict:
        with self.lock:
            gaps = self.gaps_retired + sum(p.missing() for p in self.pubs.values())
            return {"frames_lost_in_transport": max(gaps, self.rmw_lost),
                    "transport.sequence_gaps": gaps, "transport.rmw_message_lost": self.rmw_lost,
                    "transport.no_sequence_number": self.no_sequence,
                    "transport.duplicates": self.duplicates}

    def window(self, now: float, seconds: float) -> dict:
        """Losses in the last `seconds`: lost (the larger source), gaps, rmw."""
        with self.lock:
            gaps = sum(n for t, n in self.gap_events if now - t <= seconds)
            rmw = sum(n for t, n in self.rmw_events if now - t <= seconds)
        gaps = max(0, gaps)
        return {"lost": max(gaps, rmw), "gaps": gaps, "rmw": rmw}


def loss_problem(window: dict, received: int, seconds: float) -> str | None:
    """The WARN text when losses in the window are high, else None."""
    lost = window["lost"]
    if lost < WARN_MIN_LOST or lost <= WARN_FRACTION * received:
        return None
    pct = 100.0 * lost / max(received, 1)
    why = []
    if window["rmw"]:
        why.append(f"{window['rmw']} reported lost by the rmw (transport or the publisher's "
                   "history; raw frames over 512 KiB on one host: config/fastdds_large_images.xml)")
    queue = window["gaps"] - window["rmw"]
    if queue > 0:
        why.append(f"{queue} more missing from the publisher's sequence (not taken in time: the "
                   "subscription queue overflowed while the node's image callbacks were behind; "
                   "a larger qos_depth or a lower camera rate helps)")
    return (f"{lost} frames lost before the node in the last {seconds:.0f} s ({pct:.1f}% of the "
            f"{received} received): " + "; ".join(why))
