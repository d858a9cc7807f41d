"""A LoweredModule as plain JSON values and back: no pickle, nothing but data is ever loaded.

The compile cache and AOT artifacts store the call description of a lowered module (which graph
inputs are tensors, output slots, mutations, specs with torch dtypes by name) in a JSON manifest
beside the StableHLO text and bytecode, which travel as separate files. `disk_codec` is the
compile cache's form of a compiled value: (executable, LoweredModule) ↔ files and a manifest.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_inductor.cache import stores
from tpu_inductor.lowering import LoweredModule, OutputSlot, PartialWrite, Shardings, TensorSpec
from tpu_inductor.runtime import devices

_SCALARS = (type(None), bool, int, float, str)


class NotSerializable(ValueError):
    """A lowered module holds a value with no JSON form (it is then not stored)."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` → "float32"."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """ "float32" → `torch.float32`; a ValueError for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name")
    return dtype


def spec_to_json(spec: TensorSpec) -> dict[str, Any]:
    return {"shape": list(spec.shape), "dtype": dtype_name(spec.dtype)}


def spec_from_json(data: dict[str, Any]) -> TensorSpec:
    shape = data["shape"]
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        raise ValueError(f"bad tensor shape {shape!r}")
    return TensorSpec(tuple(shape), dtype_from_name(data["dtype"]))


def lowered_to_json(lowered: LoweredModule) -> dict[str, Any]:
    """The call description of `lowered` (everything but its bytecode and text)."""
    outputs = []
    for slot in lowered.outputs:
        if slot.result is not None:
            outputs.append({"result": slot.result})
        elif slot.view is not None:
            base, size, stride, offset = slot.view
            dtype = None if slot.view_dtype is None else dtype_name(slot.view_dtype)
            view = {"view": [base, list(size), list(stride), offset, dtype]}
            outputs.append(view if slot.input is None else {**view, "of_input": True})
        elif slot.input is not None:
            outputs.append({"input": slot.input})
        elif isinstance(slot.value, _SCALARS):
            outputs.append({"value": slot.value})
        else:
            raise NotSerializable(f"graph output value {slot.value!r} has no JSON form")
    return {
        "platform": lowered.platform,
        "tensor_inputs": list(lowered.tensor_inputs),
        "input_specs": [spec_to_json(s) for s in lowered.input_specs],
        "output_specs": [spec_to_json(s) for s in lowered.output_specs],
        "outputs": outputs,
        "mutations": [list(m) for m in lowered.mutations],
        "uses_rng": lowered.uses_rng,
        "x64": lowered.x64,
        "kernel_choices": dict(lowered.kernel_choices),
        "shardings": _shardings_to_json(lowered.shardings),
        "donated": list(lowered.donated),
        "partial_writes": [
            [w.position, w.piece, list(w.indices), None if w.slice is None else list(w.slice)]
            for w in lowered.partial_writes
        ],
    }


def _shardings_to_json(shardings: Shardings | None) -> dict[str, Any] | None:
    if shardings is None:
        return None
    return {
        "mesh": [[name, size] for name, size in shardings.axes],
        "inputs": [None if spec is None else list(spec) for spec in shardings.inputs],
    }


def _shardings_from_json(data: Any) -> Shardings | None:
    if data is None:
        return None
    axes = tuple((str(name), _int(size)) for name, size in data["mesh"])
    names = {name for name, _ in axes}
    inputs = tuple(None if spec is None else tuple(spec) for spec in data["inputs"])
    if any(axis is not None and axis not in names for spec in inputs for axis in spec or ()):
        raise ValueError(f"bad shardings {data!r}: an input is split over an axis not in the mesh")
    return Shardings(axes, inputs)


def lowered_from_json(data: dict[str, Any], bytecode: bytes, text: str) -> LoweredModule:
    """Rebuild a LoweredModule; a ValueError (or KeyError/TypeError) names what is malformed."""
    outputs = []
    for slot in data["outputs"]:
        if "result" in slot:
            outputs.append(OutputSlot(_int(slot["result"])))
        elif "view" in slot:
            base, size, stride, offset, dtype = slot["view"]
            view = (_int(base), tuple(map(_int, size)), tuple(map(_int, stride)), _int(offset))
            dtype = None if dtype is None else dtype_from_name(dtype)
            source = view[0] if slot.get("of_input") is True else None
            outputs.append(OutputSlot(None, input=source, view=view, view_dtype=dtype))
        elif "input" in slot:
            outputs.append(OutputSlot(None, input=_int(slot["input"])))
        elif isinstance(slot["value"], _SCALARS):
            outputs.append(OutputSlot(None, slot["value"]))
        else:
            raise ValueError(f"bad output slot {slot!r}")
    if not isinstance(data["uses_rng"], bool) or data["x64"] not in ("keep", "narrow"):
        raise ValueError("bad uses_rng or x64 field")
    return LoweredModule(
        bytecode=bytecode,
        text=text,
        platform=str(data["platform"]),
        tensor_inputs=tuple(_int(i) for i in data["tensor_inputs"]),
        input_specs=tuple(spec_from_json(s) for s in data["input_specs"]),
        output_specs=tuple(spec_from_json(s) for s in data["output_specs"]),
        outputs=tuple(outputs),
        mutations=tuple((_int(p), _int(r)) for p, r in data["mutations"]),
        uses_rng=data["uses_rng"],
        x64=data["x64"],
        shardings=_shardings_from_json(data.get("shardings")),
        kernel_choices={str(k): _int(n) for k, n in data.get("kernel_choices", {}).items()},
        donated=tuple(_int(i) for i in data.get("donated", ())),
        partial_writes=tuple(_partial_write(w) for w in data.get("partial_writes", ())),
    )


def _partial_write(data: list) -> PartialWrite:
    position, piece, indices, bounds = data
    return PartialWrite(
        _int(position),
        _int(piece),
        tuple(None if i is None else _int(i) for i in indices),
        None if bounds is None else tuple(_int(b) for b in bounds),
    )


def _int(value) -> int:
    if type(value) is not int:
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def disk_codec(device: devices.Device) -> stores.Codec:
    """(executable, LoweredModule) ↔ files and a JSON manifest, for the disk cache."""

    def encode(value):
        executable, lowered = value
        meta = {"lowered": lowered_to_json(lowered)}
        files = {
            "executable.bin": devices.serialize_executable(executable, device),
            "module.mlirbc": lowered.bytecode,
            "module.mlir": lowered.text.encode(),
        }
        return files, meta

    def decode(files, meta):
        text = files["module.mlir"].decode()
        lowered = lowered_from_json(meta["lowered"], files["module.mlirbc"], text)
        executable = devices.deserialize_executable(files["executable.bin"], device, text)
        return executable, lowered

    return stores.Codec(encode, decode)
