"""The worker half of ortq: one process, one ONNX Runtime session, one model queue.

Importing this package does not import ONNX Runtime; creating a worker does.
"""
