"""The perception node over real DDS with a Gemma 4 tiny model (the node, a camera and this
test are separate processes): a detect task in its YAML is refused at configure with the
model's own message, the node serves the query task, and Query / SetTasks / parameter updates
asking for what Gemma 4 does not serve (detect, point, crops 'global') are refused with it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")
pytest.importorskip("torch")

from node_helpers import (REPO, Collector, child_env, diag_values, spawn_camera,  # noqa: E402
                          spawn_node, stop, wait_for, write_config)

GEMMA_DETECT = "Gemma 4 (E2B/E4B) does not support detect"
TOPIC = "/pf/front/image"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from diagnostic_msgs.msg import DiagnosticArray

    from photon_ros.msg import Answer, DetectionArray
    from photon_ros.srv import Query

    base = tmp_path_factory.mktemp("gemma_node")
    model = base / "gemma4"
    subprocess.run([sys.executable, "-m", "photon_core.cli", "make-test-model", "gemma4",
                    str(model)], check=True, cwd=REPO, env=child_env(), capture_output=True,
                   timeout=300)
    cfg = write_config(base / "gemma.yaml", {
        "max_batch": 2, "default_deadline_ms": 60000.0, "on_demand_deadline_ms": 60000.0,
        "cameras": ["front"],
        "front": {"topic": TOPIC, "tasks": ["people", "scene"],
                  "people": {"skill": "detect", "object": "person", "max_objects": 2},
                  "scene": {"skill": "query", "question": "what is here?", "max_tokens": 3,
                            "every_n": 2, "on_miss": "finish"}}})
    node = spawn_node("-p", f"model:={model}", "-p", f"params_file:={cfg}")
    col = Collector("photon_test_families")
    col.listen(DetectionArray, "/front/detections")
    col.listen(Answer, "/front/answer")
    col.listen(DiagnosticArray, "/diagnostics")
    client = col.node.create_client(Query, "/perception_node/query")
    if not client.wait_for_service(timeout_sec=180):
        out = stop(node)
        col.close()
        pytest.fail(f"node did not come up:\n{out}")
    cam = spawn_camera("--topic", TOPIC, "--fps", "2", "--stamp0", "300.0")
    ok = wait_for(lambda: len(col.msgs("/front/answer")) >= 1, timeout=240)
    if not ok:
        out_cam, out = stop(cam), stop(node)
        col.close()
        pytest.fail(f"no answer from the node:\n{out}\ncamera:\n{out_cam}")
    yield {"col": col, "node": node, "query": client, "cam": cam}
    stop(cam)
    col.close()
    out = stop(node)
    assert "Traceback" not in out, out
    # the refusal at configure, with the model's own message, in the node's log
    assert f"front.people refused: {GEMMA_DETECT}" in out, out


def test_yaml_detect_refused_and_query_served(env):
    col = env["col"]
    answers = col.msgs("/front/answer")
    assert answers and all(a.task.name == "scene" and a.camera == "front" for a in answers)
    assert all(a.tokens == 3 or a.finish_reason == "stop" for a in answers)
    assert not col.msgs("/front/detections")

    def node_diag():
        for arr in reversed(col.msgs("/diagnostics")):
            v = diag_values(arr, "node")
            if v is not None:
                return v
        return None
    assert wait_for(lambda: node_diag() is not None, timeout=15)
    assert node_diag().get("refused_tasks") == "1", node_diag()
    assert env["node"].poll() is None


def test_query_refuses_detect_and_answers_a_question(env):
    from photon_ros.srv import Query

    col, client = env["col"], env["query"]
    res = col.call(client, Query.Request(camera="front", skill="detect", object="cup"))
    assert not res.success and GEMMA_DETECT in res.message, res.message
    res = col.call(client, Query.Request(camera="front", skill="point", object="cup"))
    assert not res.success and "does not support point" in res.message, res.message
    res = col.call(client, Query.Request(camera="front", skill="query", question="color?",
                                         max_tokens=2), timeout=120)
    assert res.success and res.result_type == "answer" and res.answer.tokens >= 1, res.message


def test_set_tasks_and_parameters_refuse_what_gemma_does_not_serve(env):
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    from photon_ros.msg import TaskSpec
    from photon_ros.srv import SetTasks

    col = env["col"]
    set_tasks = col.node.create_client(SetTasks, "/perception_node/set_tasks")
    res = col.call(set_tasks, SetTasks.Request(camera="front", tasks=[
        TaskSpec(name="scene", skill="caption", caption_length="short", max_tokens=2),
        TaskSpec(name="cups", skill="detect", object="cup")]))
    assert not res.success and GEMMA_DETECT in res.message, res.message

    setp = col.node.create_client(SetParameters, "/perception_node/set_parameters")

    def param(name, value):
        return Parameter(name=name, value=ParameterValue(
            type=ParameterType.PARAMETER_STRING, string_value=value))
    # (parameters are set one by one: the object first, so that point is a valid task)
    res = col.call(setp, SetParameters.Request(parameters=[param("front.scene.object", "x")]))
    assert res.results[0].successful, res.results[0].reason
    res = col.call(setp, SetParameters.Request(parameters=[param("front.scene.skill", "point")]))
    assert not res.results[0].successful
    assert "front.scene refused: Gemma 4 (E2B/E4B) does not support point" in \
        res.results[0].reason, res.results[0].reason
    res = col.call(setp, SetParameters.Request(parameters=[param("front.crops", "global")]))
    assert not res.results[0].successful and "does not support crops 'global'" in \
        res.results[0].reason, res.results[0].reason
    # the refused task's own parameters may change (it stays refused, quietly)
    res = col.call(setp, SetParameters.Request(parameters=[param("front.people.object", "dog")]))
    assert res.results[0].successful, res.results[0].reason
    # the node still serves its query task
    n = len(col.msgs("/front/answer"))
    assert wait_for(lambda: len(col.msgs("/front/answer")) > n, timeout=120)
    assert not col.msgs("/front/detections")
    assert env["node"].poll() is None
