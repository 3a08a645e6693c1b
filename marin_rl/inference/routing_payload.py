"""The wire form of a mixture-of-experts policy's routing (routing replay, `marin_rl.model.moe`): a completion
choice's `routed_experts`, asked for with `return_routed_experts: true`.

`{"shape": [tokens, layers × k], "dtype": "int16", "data": base64 of the little-endian array}`: per token of the
prompt and the completion, the experts it went to in each expert layer, layer-major, -1 where none was recorded (the
last sampled token, never fed to the model). Compact: 2 bytes an entry, where JSON lists of integers take 2 to 4.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

_DTYPE = np.dtype("<i2")


def encode_routes(routes: np.ndarray) -> dict[str, Any]:
    """The JSON-compatible form of `routes` [tokens, layers × k]."""
    routes = np.ascontiguousarray(routes, dtype=_DTYPE)
    if routes.ndim != 2:
        raise ValueError(f"routed experts must be [tokens, layers × k], got shape {routes.shape}")
    return {"shape": list(routes.shape), "dtype": "int16", "data": base64.b64encode(routes.tobytes()).decode()}


def decode_routes(payload: Any, tokens: int) -> np.ndarray:
    """`encode_routes`'s inverse, for a choice of `tokens` prompt and sampled tokens; ValueError naming what is wrong
    with a malformed payload."""
    if not isinstance(payload, dict) or payload.get("dtype") != "int16" or not isinstance(payload.get("data"), str):
        raise ValueError(f"routed_experts must be {{'shape', 'dtype': 'int16', 'data'}}, got {str(payload)[:80]!r}")
    shape = payload.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"routed_experts shape must be [tokens, layers × k], got {shape!r}")
    if shape[0] != tokens:
        raise ValueError(f"routed_experts covers {shape[0]} tokens, but the prompt and completion have {tokens}")
    data = base64.b64decode(payload["data"], validate=True)
    if len(data) != shape[0] * shape[1] * _DTYPE.itemsize:
        raise ValueError(f"routed_experts holds {len(data)} bytes for shape {shape}")
    return np.frombuffer(data, _DTYPE).reshape(shape).astype(np.int16)
