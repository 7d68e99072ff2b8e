"""What this family reuses from the rest of photon_core (task contract, sampling, streaming,
image input). Moondream's helpers are being moved to photon_core/models/moondream2/; this
file is the one place that knows where they live."""
from __future__ import annotations

from ...task import (FINISH_LENGTH, FINISH_STOP, Task, TaskError, TaskResult,  # noqa: F401
                     build_result)

try:  # after the move
    from ..moondream2.image_input import ImageError, to_rgb_array  # noqa: F401
    from ..moondream2.sampling import sample  # noqa: F401
    from ..moondream2.streaming import TextStreamer  # noqa: F401
except ImportError:
    from ...moondream.image_input import ImageError, to_rgb_array  # noqa: F401
    from ...moondream.sampling import sample  # noqa: F401
    from ...moondream.streaming import TextStreamer  # noqa: F401
