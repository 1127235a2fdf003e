"""Single-node ONNX models for op-rule tests: build, import into IR, check the rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.ir.graph import Graph, Node
from parc.ir.importer import from_model
from parc.ops import sharding_rule
from parc.ops.base import ShardingRule
from parc.ops.check import check_rule


@dataclass
class Arg:
    """An input that is an initializer (a shape, axes, repeats...), not data."""

    value: np.ndarray


@dataclass
class Case:
    graph: Graph
    node: Node
    arrays: list[np.ndarray | None]  # per node input: data, or None (constant or omitted)

    @property
    def opset(self) -> dict[str, int]:
        return self.graph.opset

    def rule(self) -> ShardingRule | None:
        return sharding_rule(self.node, self.graph.opset.get(""))

    def check(self, **kw) -> list[str]:
        return check_rule(self.node, self.arrays, self.graph.opset, **kw)


def build(op: str, inputs: Sequence[np.ndarray | Arg | None], n_outputs: int = 1, *,
          opset: int = 18, omit: Sequence[int] = (), **attrs) -> Case:
    """A one-node model: arrays are graph inputs, `Arg`s initializers, None omitted inputs;
    outputs listed in `omit` are omitted optional outputs."""
    names, graph_inputs, inits = [], [], []
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if isinstance(a, Arg):
            inits.append(numpy_helper.from_array(np.asarray(a.value), name))
        else:
            a = np.asarray(a)
            graph_inputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)))
    outs = [f"out{j}" for j in range(n_outputs) if j not in omit]
    node = helper.make_node(op, names, [f"out{j}" if j not in omit else "" for j in range(n_outputs)],
                            **attrs)

    def model(outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
        g = helper.make_graph([node], "case", graph_inputs, outputs, initializer=inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = helper.find_min_ir_version_for(list(m.opset_import))
        return m

    graph = from_model(model([onnx.ValueInfoProto(name=o) for o in outs]))
    if not graph.nodes:  # every input was constant and the importer folded the node
        import onnxruntime as ort

        sess = ort.InferenceSession(model([onnx.ValueInfoProto(name=o) for o in outs]).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        results = sess.run(None, {})
        declared = [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(r.dtype), list(r.shape))
                    for o, r in zip(outs, results)]
        graph = from_model(model(declared), fold=False)
    assert len(graph.nodes) == 1, [n.op_type for n in graph.nodes]
    node_ir = graph.nodes[0]
    arrays: list[np.ndarray | None] = []
    by_name = {f"in{i}": a for i, a in enumerate(inputs)}
    for v in node_ir.inputs:
        a = by_name.get(v.name) if v is not None else None
        arrays.append(None if a is None or isinstance(a, Arg) else np.asarray(a))
    return Case(graph, node_ir, arrays)


def assert_rule_holds(case: Case, min_splittable: int = 0, **kw) -> ShardingRule:
    rule = case.rule()
    assert rule is not None, f"{case.node.op_type}: no rule"
    failures = case.check(**kw)
    assert not failures, "\n".join(failures[:5])
    assert len(rule.splittable()) >= min_splittable, (
        f"{case.node.op_type} rule [{rule}] has splittable {rule.splittable()}, want >= {min_splittable}")
    return rule
