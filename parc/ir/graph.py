"""The IR: a mutable Graph of Nodes over Values with static shapes, dtypes and use-lists."""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import onnx
from onnx import helper

from parc.ir.dtypes import DType
from parc.ir.tensor import TensorData

Shape = tuple[int, ...]


class Value:
    """A tensor: produced by one node, or a graph input, or a constant (`const` set)."""

    __slots__ = ("name", "dtype", "shape", "producer", "index", "uses", "const", "is_param")

    def __init__(self, name: str, dtype: DType | None = None, shape: Shape | None = None,
                 const: TensorData | None = None, is_param: bool = False) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.producer: Node | None = None
        self.index = 0
        self.uses: list[tuple[Node, int]] = []
        self.const = const
        self.is_param = is_param
        if const is not None:
            self.dtype, self.shape = const.dtype, const.shape

    @property
    def rank(self) -> int:
        assert self.shape is not None, self.name
        return len(self.shape)

    @property
    def size(self) -> int:
        assert self.shape is not None, self.name
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * (self.dtype.itemsize if self.dtype else 0)

    @property
    def is_const(self) -> bool:
        return self.const is not None

    def replace_all_uses_with(self, other: Value) -> None:
        for node, i in list(self.uses):
            node.set_input(i, other)

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {self.dtype}, {self.shape})"


class Node:
    """One operator application. Attributes are kept as ONNX AttributeProtos."""

    __slots__ = ("op_type", "domain", "name", "inputs", "outputs", "attrs", "meta")

    def __init__(self, op_type: str, inputs: Iterable[Value | None], outputs: Iterable[Value],
                 attrs: dict[str, onnx.AttributeProto] | None = None, name: str = "",
                 domain: str = "", meta: dict[str, str] | None = None) -> None:
        self.op_type = op_type
        self.domain = domain
        self.name = name
        self.inputs: list[Value | None] = []
        self.outputs: list[Value] = list(outputs)
        self.attrs: dict[str, onnx.AttributeProto] = dict(attrs or {})
        self.meta: dict[str, str] = dict(meta or {})
        for i, v in enumerate(inputs):
            self.inputs.append(v)
            if v is not None:
                v.uses.append((self, i))
        for i, v in enumerate(self.outputs):
            v.producer, v.index = self, i

    def attr(self, name: str, default: Any = None) -> Any:
        """The attribute's Python value (ints, floats, strings, lists, np arrays), or default."""
        proto = self.attrs.get(name)
        if proto is None:
            return default
        if proto.type == onnx.AttributeProto.TENSOR:
            return onnx.numpy_helper.to_array(proto.t)
        value = helper.get_attribute_value(proto)
        if isinstance(value, bytes):
            return value.decode()
        if isinstance(value, list) and value and isinstance(value[0], bytes):
            return [v.decode() for v in value]
        return value

    def set_attr(self, name: str, value: Any) -> None:
        self.attrs[name] = helper.make_attribute(name, value)

    def input(self, i: int) -> Value | None:
        """Input i, or None when absent or omitted."""
        return self.inputs[i] if i < len(self.inputs) else None

    def set_input(self, i: int, value: Value | None) -> None:
        old = self.inputs[i]
        if old is not None:
            old.uses.remove((self, i))
        self.inputs[i] = value
        if value is not None:
            value.uses.append((self, i))

    def detach(self) -> None:
        """Drop this node's uses of its inputs (before removing it from a graph)."""
        for i in range(len(self.inputs)):
            self.set_input(i, None)

    @property
    def label(self) -> str:
        return self.name or f"{self.op_type}->{self.outputs[0].name if self.outputs else '?'}"

    def __repr__(self) -> str:
        ins = ", ".join(v.name if v else "" for v in self.inputs)
        outs = ", ".join(v.name for v in self.outputs)
        return f"Node({self.op_type} {self.name!r}: {ins} -> {outs})"


def const_key(v: Value, limit: int = 4096) -> bytes | None:
    """The value of a non-parameter constant of at most `limit` elements (a shape operand, say), as
    bytes (a SHA-256 digest past 64 bytes); None for anything else."""
    if v.const is None or v.is_param or v.shape is None or v.size > limit:
        return None
    data = np.asarray(v.const.numpy()).tobytes()
    return hashlib.sha256(data).digest() if len(data) > 64 else data


def node_signature(n: Node, const_limit: int = 4096) -> tuple:
    """What a node computes, its names aside: op, attributes, input and output shapes and dtypes,
    and the values of its non-parameter constant inputs of at most `const_limit` elements. Nodes
    of a model's repeated layers share one (their strategies, their inferred types)."""
    ins = tuple(None if v is None else (v.shape, v.dtype, const_key(v, const_limit)) for v in n.inputs)
    outs = tuple((v.shape, v.dtype, bool(v.name)) for v in n.outputs)
    attrs = tuple(sorted((k, a.SerializeToString(deterministic=True)) for k, a in n.attrs.items()))
    return (n.domain, n.op_type, attrs, ins, outs)


class NameAuthority:
    """Hands out names unique within one graph (no process-global counters)."""

    def __init__(self) -> None:
        self.used: set[str] = set()
        self.counters: dict[str, int] = {}

    def claim(self, name: str) -> None:
        self.used.add(name)

    def fresh(self, prefix: str) -> str:
        n = self.counters.get(prefix, 0)
        while f"{prefix}_{n}" in self.used:
            n += 1
        self.counters[prefix] = n + 1
        name = f"{prefix}_{n}"
        self.used.add(name)
        return name


class Graph:
    """A program: nodes in topological order, graph inputs/outputs, and constants."""

    def __init__(self, name: str = "main", opset: dict[str, int] | None = None) -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.constants: dict[str, Value] = {}
        # Constants that are also graph inputs (ONNX initializers listed as inputs): a training
        # step's parameters and optimizer state, fed anew each step, with their initial values.
        self.input_constants: list[Value] = []
        self.opset: dict[str, int] = dict(opset or {"": 18})
        self.metadata: dict[str, str] = {}
        self.names = NameAuthority()

    # -- construction -------------------------------------------------------------------
    def add_input(self, name: str, dtype: DType, shape: Shape) -> Value:
        self.names.claim(name)
        v = Value(name, dtype, shape)
        self.inputs.append(v)
        return v

    def add_constant(self, data: TensorData, name: str | None = None,
                     is_param: bool = False) -> Value:
        name = name or self.names.fresh("const")
        self.names.claim(name)
        v = Value(name, const=data, is_param=is_param)
        self.constants[name] = v
        return v

    def add_node(self, op_type: str, inputs: Iterable[Value | None], n_outputs: int = 1,
                 attrs: dict[str, Any] | None = None, name: str | None = None,
                 domain: str = "", output_names: list[str] | None = None) -> Node:
        """Append a node with fresh output values (shapes filled by type inference)."""
        names = output_names or [self.names.fresh(f"{op_type.lower()}_out") for _ in range(n_outputs)]
        for n in names:
            self.names.claim(n)
        protos = {k: helper.make_attribute(k, a) for k, a in (attrs or {}).items()}
        node = Node(op_type, inputs, [Value(n) for n in names], protos,
                    name or self.names.fresh(op_type), domain)
        self.nodes.append(node)
        return node

    def remove_nodes(self, dead: Iterable[Node]) -> None:
        dead_ids = {id(n) for n in dead}
        for n in self.nodes:
            if id(n) in dead_ids:
                n.detach()
        self.nodes = [n for n in self.nodes if id(n) not in dead_ids]

    # -- queries -------------------------------------------------------------------------
    def values(self) -> Iterator[Value]:
        """Every value once: inputs, constants, then node outputs in order."""
        yield from self.inputs
        yield from self.constants.values()
        for n in self.nodes:
            yield from (v for v in n.outputs if v.name)

    def params(self) -> list[Value]:
        return [v for v in self.constants.values() if v.is_param]

    def toposort(self) -> None:
        """Reorder nodes topologically, keeping the current order where it is free to."""
        position = {id(n): i for i, n in enumerate(self.nodes)}
        indegree = {id(n): 0 for n in self.nodes}
        users: dict[int, list[Node]] = {id(n): [] for n in self.nodes}
        for n in self.nodes:
            producers = {id(v.producer) for v in n.inputs if v is not None and v.producer is not None}
            producers &= position.keys()
            indegree[id(n)] = len(producers)
            for p in producers:
                users[p].append(n)
        ready = [(position[id(n)], n) for n in self.nodes if indegree[id(n)] == 0]
        heapq.heapify(ready)
        order: list[Node] = []
        while ready:
            _, n = heapq.heappop(ready)
            order.append(n)
            for u in users[id(n)]:
                indegree[id(u)] -= 1
                if indegree[id(u)] == 0:
                    heapq.heappush(ready, (position[id(u)], u))
        if len(order) != len(self.nodes):
            stuck = next(n for n in self.nodes if indegree[id(n)] > 0)
            from parc.errors import VerifyError
            raise VerifyError(f"graph has a cycle through node '{stuck.label}'")
        self.nodes = order

    def dead_code_elimination(self) -> int:
        """Remove nodes and constants that no graph output depends on; return how many."""
        live: set[int] = {id(v) for v in self.outputs}
        keep: list[Node] = []
        for n in reversed(self.nodes):
            if any(id(v) in live for v in n.outputs):
                keep.append(n)
                live.update(id(v) for v in n.inputs if v is not None)
        dead = [n for n in self.nodes if not any(id(v) in live for v in n.outputs)]
        self.remove_nodes(dead)
        unused = [k for k, v in self.constants.items() if not v.uses and id(v) not in live]
        for k in unused:
            del self.constants[k]
        self.input_constants = [v for v in self.input_constants if v.name in self.constants]
        return len(dead) + len(unused)
