"""Drawing results on the camera image (the `<camera>/annotated` topic)."""
from __future__ import annotations

import numpy as np

from photon_ros.msg import DetectionArray, PointArray


def annotate(image: np.ndarray, msg) -> np.ndarray:
    """A copy of `image` (RGB) with the boxes/points of `msg` drawn on it (cv2)."""
    import cv2

    out = np.ascontiguousarray(image).copy()
    color = (255, 64, 0)
    if isinstance(msg, DetectionArray):
        for d in msg.detections:
            x0, y0 = int(d.bbox.center_x - d.bbox.size_x / 2), int(d.bbox.center_y - d.bbox.size_y / 2)
            x1, y1 = int(d.bbox.center_x + d.bbox.size_x / 2), int(d.bbox.center_y + d.bbox.size_y / 2)
            cv2.rectangle(out, (x0, y0), (x1, y1), color, 2)
            cv2.putText(out, d.label, (x0, max(12, y0 - 4)), cv2.FONT_HERSHEY_SIMPLEX, 0.5, color, 1)
    elif isinstance(msg, PointArray):
        for p in msg.points:
            cv2.circle(out, (int(p.x), int(p.y)), 5, color, -1)
    return out
