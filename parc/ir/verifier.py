"""What valid IR is: every pass may assume it and must preserve it."""

from __future__ import annotations

from parc.errors import ParcError, VerifyError
from parc.ir.graph import Graph
from parc.ir.shapes import output_types


def verify(graph: Graph, *, types: bool = True) -> None:
    """Raise VerifyError on the first broken invariant.

    - nodes are in topological order and read only values defined before them;
    - use-lists match the node inputs exactly; names are unique; graph outputs are defined;
    - every value has a dtype and a static shape; with `types`, the shapes and dtypes agree with
      the op's ONNX schema (the op rules' own checks are `parc.ops.verify`'s).
    """

    defined: set[int] = set()
    names: set[str] = set()

    def define(v, where: str) -> None:
        if v.name in names:
            raise VerifyError(f"value name '{v.name}' is defined twice ({where})")
        names.add(v.name)
        defined.add(id(v))
        if v.dtype is None or v.shape is None or any(not isinstance(d, int) or d < 0 for d in v.shape):
            raise VerifyError(f"value '{v.name}' ({where}) has no static shape/dtype: "
                              f"{v.dtype} {v.shape}")

    for v in graph.inputs:
        define(v, "graph input")
    for name, v in graph.constants.items():
        if name != v.name or v.const is None:
            raise VerifyError(f"constant table entry '{name}' is not the constant it names")
        define(v, "constant")
    for v in graph.input_constants:
        if graph.constants.get(v.name) is not v:
            raise VerifyError(f"input constant '{v.name}' is not one of the graph's constants")
    for node in graph.nodes:
        for i, v in enumerate(node.inputs):
            if v is None:
                continue
            if id(v) not in defined:
                raise VerifyError(f"node '{node.label}' reads '{v.name}' before it is defined "
                                  f"(not topological, or dangling)")
            if (node, i) not in [(u, j) for u, j in v.uses]:
                raise VerifyError(f"use-list of '{v.name}' misses node '{node.label}' input {i}")
        for i, v in enumerate(node.outputs):
            if not v.name:
                continue  # omitted optional output
            if v.producer is not node or v.index != i:
                raise VerifyError(f"value '{v.name}' does not point back to its producer '{node.label}'")
            define(v, f"output of '{node.label}'")
    for v in graph.values():
        for u, j in v.uses:
            if j >= len(u.inputs) or u.inputs[j] is not v:
                raise VerifyError(f"use-list of '{v.name}' names '{u.label}' input {j}, which reads "
                                  f"something else")
    for v in graph.outputs:
        if id(v) not in defined:
            raise VerifyError(f"graph output '{v.name}' is not defined")
    if not types:
        return
    for node in graph.nodes:
        try:
            expected = output_types(node, graph.opset)
        except ParcError as e:
            raise VerifyError(str(e)) from None
        for v, (dtype, shape) in zip(node.outputs, expected or []):
            if not v.name:
                continue
            if (dtype is not None and dtype != v.dtype) or (shape is not None and shape != v.shape):
                raise VerifyError(f"node '{node.label}' ({node.op_type}): output '{v.name}' is "
                                  f"{v.dtype}{list(v.shape or ())}, its schema gives "
                                  f"{dtype}{list(shape or ())}")
