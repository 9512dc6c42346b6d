"""ONNX Runtime's own log lines in a worker's log (issue 35: a new user met its raw, coloured
warnings, e.g. webgpu's at every start, CUDA's "No registered plugin EP device found"): by default
a worker lets through its errors alone; ``--ort-log-level warning`` lets its warnings through again.

The model has an initializer no node uses, which ONNX Runtime warns about ("Removing initializer")
when it makes the session: a warning every ONNX Runtime gives, on any machine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortq.producer import Producer
from ortq.settings import Settings
from tests.conftest import WorkerProcesses

ORT_WARNING = "Removing initializer 'unused'"


@pytest.fixture(scope="module")
def warned_model(models_dir: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    unused = numpy_helper.from_array(np.ones(4, np.float32), "unused")
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "warned", [x], [y], [unused])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = models_dir / "warned.onnx"
    onnx.save(model, path)
    return path


@pytest.mark.parametrize(("extra", "shown"), [((), False), (("--ort-log-level", "warning"), True)])
def test_onnx_runtimes_warnings_are_kept_out_of_the_log_unless_asked_for(
    workers: WorkerProcesses, warned_model: Path, model_name: str, redis_url: str, extra: tuple[str, ...], shown: bool
) -> None:
    workers.serve(warned_model, model_name, redis_url, 1, *extra)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        outputs = producer.infer(model_name, {"x": x}, timeout=30)
    direct = ort.InferenceSession(str(warned_model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(outputs["y"], direct)
    assert (ORT_WARNING in workers.logs()) is shown, workers.logs()
