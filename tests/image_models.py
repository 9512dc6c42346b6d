"""Models that take an encoded image (a JPEG's or PNG's bytes as a uint8 vector) and decode it
themselves with onnxruntime-extensions' ``DecodeImage`` (``ortq worker --custom-ops
onnxruntime_extensions``), and the JPEG files to feed them.

The decoder is in the domain ``com.microsoft.extensions`` (not ``ai.onnx.contrib``, where
onnxruntime-extensions' PyPI build registers no image decoder: its ``ImageDecoder`` there needs
OpenCV, which that build leaves out). It yields the image as uint8 ``[height, width, 3]``, BGR.

* :func:`decoding_conv_model` -- ``encoded`` uint8 ``["num_bytes"]`` -> :func:`conv_model`'s
  ``logits`` float32 ``[1, 10]``: decode, scale to [0, 1], HWC -> NCHW, optionally resize to
  224x224, then the same four convolutions and weights as ``tests.onnx_models.conv_model``.
* :func:`jpeg_bytes` -- a synthetic photo-like image of any size as JPEG bytes (Pillow).
* :func:`mutated` -- a file with a few bytes changed, cut out or cut off, for fuzzing the check
  (ortq.worker.encoded_images) that stands between a job's bytes and the decoder.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from tests.onnx_models import _save, conv_layers

#: onnxruntime-extensions' domain of its image codec operators, and the version it registers.
EXTENSIONS_DOMAIN = "com.microsoft.extensions"
EXTENSIONS_VERSION = 1
#: The side conv_model takes.
SIDE = 224


def decoding_conv_model(path: Path, resize: bool = True) -> Path:
    """Input ``encoded`` uint8 ``["num_bytes"]`` (a JPEG or PNG file's bytes) -> output ``logits``
    float32 ``[1, 10]``. With ``resize``, any image size (bilinear to 224x224); without, the
    decoded pixels go to the convolutions as they are, so that a 224x224 image's logits equal
    ``conv_model``'s on :func:`decoded_tensor` of it (bench/images.py compares the two paths)."""
    scaled = "nchw" if resize else "image"
    nodes = [
        helper.make_node("DecodeImage", ["encoded"], ["decoded"], domain=EXTENSIONS_DOMAIN),
        helper.make_node("Cast", ["decoded"], ["hwc"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["hwc", "full_scale"], ["unit"]),
        helper.make_node("Transpose", ["unit"], ["chw"], perm=[2, 0, 1]),
        helper.make_node("Unsqueeze", ["chw", "batch_axis"], [scaled]),
    ]
    weights: dict[str, np.ndarray] = {
        "full_scale": np.array(255.0, dtype=np.float32),
        "batch_axis": np.array([0], dtype=np.int64),
    }
    if resize:
        nodes.append(helper.make_node("Resize", ["nchw", "", "", "size"], ["image"], mode="linear"))
        weights["size"] = np.array([1, 3, SIDE, SIDE], dtype=np.int64)
    conv_nodes, conv_weights = conv_layers("image")
    return _save(
        path,
        "decoding_conv",
        nodes=nodes + conv_nodes,
        inputs=[helper.make_tensor_value_info("encoded", TensorProto.UINT8, ["num_bytes"])],
        outputs=[helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        initializers={**weights, **conv_weights},
        domains={EXTENSIONS_DOMAIN: EXTENSIONS_VERSION},
    )


def synthetic_photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[height, width, 3]`` RGB: smooth gradients, a few soft shapes and mild noise, which JPEG
    compresses about as it does a photo (random noise would not compress at all, flat colour to nothing)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.zeros((height, width, 3), np.float32)
    for channel in range(3):
        fx, fy, phase = rng.uniform(0.5, 4.0), rng.uniform(0.5, 4.0), rng.uniform(0, 2 * np.pi)
        image[..., channel] = 128 + 60 * np.sin(2 * np.pi * (fx * x / width + fy * y / height) + phase)
    for _ in range(12):
        cy, cx, radius = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(8, 50)
        blob = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * radius**2))
        image += blob[..., None] * rng.uniform(-90, 90, size=3)
    image += rng.normal(0, 14, size=image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def jpeg_bytes(pixels: np.ndarray, quality: int = 90, progressive: bool = False) -> bytes:
    """``pixels`` (uint8 HxWx3 RGB) as a JPEG file (baseline, or progressive)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="JPEG", quality=quality, progressive=progressive)
    return out.getvalue()


def mutated(data: bytes, seed: int) -> bytes:
    """``data`` with 1-5 changes drawn from ``seed``: a byte of the headers (the first 700) or of
    anywhere set to a random value, or 1-49 bytes cut out."""
    rng = np.random.default_rng(seed)
    out = bytearray(data)
    for _ in range(rng.integers(1, 6)):
        change = rng.integers(0, 3)
        if change == 2:
            cut = int(rng.integers(2, len(out)))
            out = out[:cut] + out[cut + int(rng.integers(1, 50)) :]
        else:
            out[int(rng.integers(2, min(700, len(out)) if change == 0 else len(out)))] = int(rng.integers(0, 256))
    return bytes(out)


def decoded_tensor(decoded_bgr: np.ndarray) -> np.ndarray:
    """What :func:`decoding_conv_model` (``resize=False``) feeds its convolutions for a decoder
    output ``decoded_bgr`` (uint8 HxWx3): float32 ``[1, 3, H, W]`` in [0, 1]."""
    return np.ascontiguousarray((decoded_bgr.astype(np.float32) / np.float32(255.0)).transpose(2, 0, 1)[None])


def decoder_model(path: Path) -> Path:
    """Input ``encoded`` uint8 ``["num_bytes"]`` -> output ``decoded`` uint8 ``["height", "width", 3]``
    (BGR): the decoder alone, to see exactly what a model's convolutions get."""
    return _save(
        path,
        "decoder",
        nodes=[helper.make_node("DecodeImage", ["encoded"], ["decoded"], domain=EXTENSIONS_DOMAIN)],
        inputs=[helper.make_tensor_value_info("encoded", TensorProto.UINT8, ["num_bytes"])],
        outputs=[helper.make_tensor_value_info("decoded", TensorProto.UINT8, ["height", "width", 3])],
        domains={EXTENSIONS_DOMAIN: EXTENSIONS_VERSION},
    )
