"""Tensors of the Open Inference Protocol (KServe v2): a request's BYTES input to texts, and
a model's outputs to the response's tensors, each in JSON or in Triton's binary tensor data
(``Inference-Header-Content-Length``: the JSON header, then the raw tensors)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from models import ModelInfo

from ..errors import ApiError
from ..lean import JsonAnswer, encode_json
from .kserve_schemas import HEADER_LENGTH, InferenceRequest

INPUT_NAME = "text"
MODEL_VERSION = "1"


def split_body(raw: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return raw, b""
    if not header_length.isdigit() or int(header_length) > len(raw):
        raise ApiError(400, "invalid_request", f"bad {HEADER_LENGTH} header {header_length!r}")
    split = int(header_length)
    return raw[:split], raw[split:]


def input_texts(request: InferenceRequest, binary: bytes) -> list[str]:
    if len(request.inputs) != 1 or request.inputs[0].name != INPUT_NAME:
        names = [tensor.name for tensor in request.inputs]
        raise ApiError(
            400, "invalid_request",
            f"expected exactly one input tensor named {INPUT_NAME!r}, got {names}",
        )  # fmt: skip
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise ApiError(
            400, "invalid_request", f"input {INPUT_NAME!r} must be BYTES, not {tensor.datatype}"
        )
    count = math.prod(tensor.shape)
    binary_size = (tensor.parameters or {}).get("binary_data_size")
    if binary_size is not None:
        if type(binary_size) is not int or binary_size != len(binary):
            raise ApiError(400, "invalid_request", "binary_data_size does not match the body")
        elements = _decode_binary_bytes(binary)
    elif tensor.data is None:
        raise ApiError(400, "invalid_request", f"input {INPUT_NAME!r} has no data")
    else:
        elements = _flatten(tensor.data)
    if len(elements) != count:
        raise ApiError(
            400, "invalid_request",
            f"input {INPUT_NAME!r} has shape {tensor.shape} ({count} elements) but "
            f"{len(elements)} values",
        )  # fmt: skip
    texts = []
    for index, element in enumerate(elements):
        if isinstance(element, bytes):
            try:
                element = element.decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(400, "invalid_request", f"element {index} is not UTF-8") from None
        if not isinstance(element, str):
            raise ApiError(400, "invalid_request", f"element {index} of a BYTES tensor is not text")
        texts.append(element)
    return texts


def _flatten(data: list[Any]) -> list[Any]:
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def _decode_binary_bytes(buffer: bytes) -> list[bytes]:
    """Triton's BYTES wire format: each element is a 4-byte little-endian length and bytes."""
    elements, offset = [], 0
    while offset < len(buffer):
        if offset + 4 > len(buffer):
            raise ApiError(400, "invalid_request", "truncated BYTES element length")
        size = int.from_bytes(buffer[offset : offset + 4], "little")
        offset += 4
        if offset + size > len(buffer):
            raise ApiError(400, "invalid_request", "truncated BYTES element")
        elements.append(buffer[offset : offset + size])
        offset += size
    return elements


def output_tensors(info: ModelInfo, outputs: list[Any]) -> dict[str, tuple[str, np.ndarray]]:
    if info.task == "classify":
        labels = np.array([str(o["label"]) for o in outputs], dtype=object)
        scores = np.array([o["score"] for o in outputs], dtype="<f4")
        return {"label": ("BYTES", labels), "score": ("FP32", scores)}
    if info.task == "sparse":  # every input's entries end to end, as a CSR matrix's rows
        sizes = [len(o["indices"]) for o in outputs]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype("<i8")
        indices = np.concatenate([np.asarray(o["indices"], dtype="<i8") for o in outputs])
        values = np.concatenate([np.asarray(o["values"], dtype="<f4") for o in outputs])
        return {"indices": ("INT64", indices), "values": ("FP32", values),
                "offsets": ("INT64", offsets)}  # fmt: skip
    return {"embedding": ("FP32", np.stack([np.asarray(o, dtype="<f4") for o in outputs]))}


def requested_outputs(
    request: InferenceRequest,
    tensors: dict[str, tuple[str, np.ndarray]],
    parameters: dict[str, Any],
) -> list[tuple[str, str, np.ndarray, bool]]:
    binary_default = bool(parameters.get("binary_data_output", False))
    if not request.outputs:
        return [(name, kind, array, binary_default) for name, (kind, array) in tensors.items()]
    wanted = []
    for output in request.outputs:
        if output.name not in tensors:
            raise ApiError(
                400, "invalid_request",
                f"unknown output {output.name!r}; this model has {sorted(tensors)}",
            )  # fmt: skip
        kind, array = tensors[output.name]
        binary = (output.parameters or {}).get("binary_data", binary_default)
        wanted.append((output.name, kind, array, bool(binary)))
    return wanted


def infer_response(
    model_name: str, request_id: str | None, outputs: list[tuple[str, str, np.ndarray, bool]]
) -> JsonAnswer:
    tensors, chunks = [], []
    for name, kind, array, binary in outputs:
        tensor: dict[str, Any] = {"name": name, "datatype": kind, "shape": list(array.shape)}
        if binary:
            chunk = _encode_binary(kind, array)
            tensor["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        elif kind == "BYTES":
            tensor["data"] = [str(value) for value in array.reshape(-1)]
        else:
            tensor["data"] = array.reshape(-1)
        tensors.append(tensor)
    body: dict[str, Any] = {"model_name": model_name, "model_version": MODEL_VERSION}
    if request_id is not None:
        body["id"] = request_id
    body["outputs"] = tensors
    header = encode_json(body)
    if not chunks:
        return JsonAnswer(header)
    return JsonAnswer(
        header + b"".join(chunks),
        media_type=b"application/octet-stream",
        headers=[(HEADER_LENGTH.lower().encode(), str(len(header)).encode())],
    )


def _encode_binary(kind: str, array: np.ndarray) -> bytes:
    if kind == "BYTES":
        parts = []
        for value in array.reshape(-1):
            encoded = str(value).encode("utf-8")
            parts.append(len(encoded).to_bytes(4, "little") + encoded)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=_NUMPY_TYPES[kind]).tobytes()


_NUMPY_TYPES = {"FP32": "<f4", "INT64": "<i8"}
