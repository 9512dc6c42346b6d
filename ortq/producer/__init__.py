"""The producer half of ortq: enqueue tensors, wait for outputs. No ONNX Runtime needed."""

from ortq.producer.producer import InferenceJob, Producer

__all__ = ["InferenceJob", "Producer"]
