"""parc's IR: graph, values and nodes with static shapes; ONNX import and export."""

from parc.ir.dtypes import DType
from parc.ir.exporter import save, to_onnx
from parc.ir.graph import Graph, Node, Value
from parc.ir.importer import from_model, load, parse_dims
from parc.ir.printer import print_graph
from parc.ir.tensor import TensorData
from parc.ir.verifier import verify

__all__ = ["DType", "Graph", "Node", "TensorData", "Value", "from_model", "load", "parse_dims",
           "print_graph", "save", "to_onnx", "verify"]
