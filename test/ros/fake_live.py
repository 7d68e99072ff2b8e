"""A PerceptionNode made active without a model (test/ros, in-process tests): a fake engine
and a fake scheduler under a real LivePipeline, so the node's own callbacks (images,
services, diagnostics) run for real and what they submit is recorded."""
from __future__ import annotations


class FakeEngine:
    def hook(self, task, stream=None, cancelled=None):
        pass


class FakeScheduler:
    def __init__(self):
        self.submitted = []

    def submit_frame(self, stream, stamp, image, tasks, kind="periodic", on_result=None,
                     capture_time=None):
        self.submitted.append(dict(stream=stream, stamp=stamp, tasks=list(tasks), kind=kind,
                                   capture_time=capture_time))


def activate_with_fakes(node, params: dict):
    """node (a PerceptionNode) configured from params and active over FakeEngine /
    FakeScheduler; its cameras set up (subscriptions: node.cameras.sync())."""
    from photon_ros.live_pipeline import LivePipeline
    from photon_ros.pipeline import PerceptionPipeline
    from photon_ros.task_config import config_from_params

    cfg = config_from_params(params)
    node.config = cfg
    node.live = LivePipeline(PerceptionPipeline(cfg, None, model_id=""), None, FakeEngine(),
                             None, FakeScheduler())
    node.cameras.reset([c.name for c in cfg.cameras])
    node.active = True
    return node
