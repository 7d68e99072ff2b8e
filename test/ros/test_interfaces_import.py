"""The message contract: every interface imports from `photon_ros` and has the agreed fields.
Also run by `colcon test` (ament_add_pytest_test) on the colcon route."""
import math

import pytest

pytest.importorskip("rclpy")


def fields(cls):
    return cls.get_fields_and_field_types()


def test_result_messages_carry_header_task_model_and_timing():
    from photon_ros.msg import Answer, DetectionArray, PointArray
    for cls in (DetectionArray, PointArray, Answer):
        f = fields(cls)
        assert f["header"] == "std_msgs/Header"
        assert f["camera"] == "string" and f["model_id"] == "string"
        assert f["task"] == "photon_ros/TaskInfo" and f["timing"] == "photon_ros/Timing"
    assert set(fields(__import__("photon_ros.msg", fromlist=["Timing"]).Timing)) == {
        "engine_ms", "queue_ms", "latency_ms"}


def test_detection_shape():
    from photon_ros.msg import BoundingBox2D, Detection, NormalizedBox
    assert set(fields(BoundingBox2D)) == {"center_x", "center_y", "size_x", "size_y"}
    assert set(fields(NormalizedBox)) == {"x_min", "y_min", "x_max", "y_max"}
    d = Detection(score=math.nan)
    assert math.isnan(d.score) and set(fields(Detection)) == {"label", "score", "bbox", "box"}


def test_answer_finish_reasons():
    from photon_ros.msg import Answer
    from photon_core.task import FINISH_REASONS
    assert {Answer.FINISH_STOP, Answer.FINISH_LENGTH, Answer.FINISH_CANCELLED,
            Answer.FINISH_DEADLINE} == set(FINISH_REASONS)


def test_services_and_action_import():
    from photon_ros.action import StreamAnswer
    from photon_ros.srv import Query, SetTasks
    assert "camera" in fields(Query.Request) and "answer" in fields(Query.Response)
    assert fields(SetTasks.Request)["tasks"] == "sequence<photon_ros/TaskSpec>"
    assert "partial_text" in fields(StreamAnswer.Feedback)
    assert "answer" in fields(StreamAnswer.Result)


def test_node_code_and_interfaces_share_the_package():
    import photon_ros
    import photon_ros.msg
    assert photon_ros.__version__
    assert photon_ros.msg.__name__ == "photon_ros.msg"
