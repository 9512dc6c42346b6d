"""The producer half of ortq: enqueue tensors, wait for outputs. No ONNX Runtime needed."""

from ortq.producer.aio import AsyncInferenceJob, AsyncProducer
from ortq.producer.producer import InferenceJob, Producer

__all__ = ["AsyncInferenceJob", "AsyncProducer", "InferenceJob", "Producer"]
