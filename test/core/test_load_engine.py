"""load_engine picks the engine by name/device; both give the same results on the CPU."""
import pytest

from photon_core import Task, load_engine


def test_auto_is_the_reference_path_on_cpu(fast_dir):
    from photon_core.moondream.model import MoondreamModel
    engine = load_engine(str(fast_dir), engine="auto", progress=False)
    assert isinstance(engine, MoondreamModel)


def test_fast_engine_on_cpu_matches_reference(fast_dir, image):
    from photon_core.fast import FastEngine
    ref = load_engine(str(fast_dir), engine="reference", progress=False)
    fast = load_engine(str(fast_dir), engine="fast", max_batch=2, progress=False)
    assert isinstance(fast, FastEngine)
    for task in (Task("detect", object="person", max_objects=4),
                 Task("query", question="what is here?", max_tokens=8)):
        a = ref.run(ref.encode_image(image), task)
        b = fast.run(fast.encode_image(image), task)
        assert a.output == b.output and a.finish_reason == b.finish_reason


def test_unknown_engine_is_a_clear_error(fast_dir):
    with pytest.raises(ValueError, match="unknown engine 'turbo'"):
        load_engine(str(fast_dir), engine="turbo")
