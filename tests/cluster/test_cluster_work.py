"""The one node pricer (`parc.cluster.work`): what each node of a graph or module asks of a device
among the others, for the search (spread over a kernel's nodes) and the task times alike."""

from __future__ import annotations

import math

import numpy as np
import pytest

from parc.cluster.cost import NodeWork
from parc.cluster.devices import DEVICES
from parc.cluster.work import graph_work, of_graph
from parc.ir.dtypes import DType
from parc.ir.graph import Graph
from parc.ir.tensor import TensorData

F32 = DType.from_numpy(np.dtype(np.float32))
N = 1 << 20


def _tree() -> Graph:
    """y = relu((x + b) * s), then a MatMul reading y: the three elementwise nodes are one tree."""
    g = Graph()
    x = g.add_input("x", F32, (1024, 1024))
    b = g.add_input("b", F32, (1024, 1024))
    s = g.add_constant(TensorData.from_array(np.float32([2.0])), "s")
    w = g.add_input("w", F32, (1024, 1024))
    (a,) = g.add_node("Add", [x, b]).outputs
    (m,) = g.add_node("Mul", [a, s]).outputs
    (r,) = g.add_node("Relu", [m]).outputs
    (y,) = g.add_node("MatMul", [r, w]).outputs
    g.outputs.append(y)
    for n in g.nodes:
        for v in n.outputs:
            v.dtype, v.shape = F32, (1024, 1024)
    return g


def test_a_fused_tree_is_one_kernel_on_a_gpu_and_its_work_spread_for_the_search():
    g, h100 = _tree(), DEVICES["h100-80g"]
    whole = graph_work(g.nodes, h100, {g.outputs[0].name})
    assert whole[0] is None and whole[1] is None  # inside the tree's kernel
    kernel = whole[2]
    assert kernel.nbytes == 3 * 4 * N + 4  # its leaves x, b and s read once, its root written once
    assert kernel.flops == 3 * N and kernel.alone
    spread = of_graph(g, h100)
    tree = spread[:3]
    assert [w.alone for w in tree] == [False, False, True]  # one launch, the root's
    assert sum(w.nbytes for w in tree) == pytest.approx(kernel.nbytes)
    assert sum(w.flops for w in tree) == kernel.flops
    # apart, each node pays its launch; in the kernel only the root does
    assert sum(w.seconds(h100) for w in tree) == pytest.approx(kernel.seconds(h100))
    # split 4 ways, every node of the kernel costs less: the search keeps them on one layout
    assert all(w.seconds(h100, split=4) < w.seconds(h100) for w in tree)
    alone = [NodeWork.of(n) for n in g.nodes[:3]]
    assert sum(w.seconds(h100) for w in alone) > 2 * kernel.seconds(h100)


def test_a_cpu_prices_what_onnxruntime_runs():
    g, cpu = Graph(), DEVICES["cpu"]
    x = g.add_input("x", F32, (256, 512))
    dy = g.add_input("dy", F32, (256, 512))
    t = g.add_node("Transpose", [x], attrs={"perm": [1, 0]}).outputs[0]
    t.dtype, t.shape = F32, (512, 256)
    grad = g.add_node("MatMul", [t, dy]).outputs[0]
    grad.dtype, grad.shape = F32, (512, 512)
    g.outputs.append(grad)
    work = of_graph(g, cpu)
    assert work[0] is None  # folded into the product, which reads x transposed
    assert work[1] == NodeWork.of(g.nodes[1])
    assert of_graph(g, DEVICES["h100-80g"])[0].nbytes == 0  # a GPU's Transpose is a view


def test_a_training_graph_spread_keeps_every_kernel_whole(tmp_path):
    """Over a real training step: spreading moves each kernel's bytes onto its nodes, no more
    and no less, and the launches drop to one per kernel."""
    from parc.ir import importer
    from tests.helpers import parc

    path = tmp_path / "gpt.onnx"
    assert parc("models", "build", "gpt-tiny", "--train", "adamw", "-o", str(path)).returncode == 0
    g = importer.load(str(path), {})
    h100 = DEVICES["h100-80g"]
    kernels = of_graph(g, h100, spread=False)
    spread = of_graph(g, h100)
    assert len(spread) == len(g.nodes) and all(w is not None for w in spread)
    assert sum(w.nbytes for w in spread) == pytest.approx(sum(w.nbytes for w in kernels if w is not None))
    assert sum(w.alone for w in spread) == sum(w is not None for w in kernels) < len(g.nodes)


def _scaled_softmax(batch: int) -> Graph:
    """p = Softmax(scores * 0.125) over (batch, 16, 4096, 4096) scores: attention's row with the
    scale before it, one kernel on the array engine while the scores have fewer than FLAT_MAX
    elements."""
    g = Graph()
    shape = (batch, 16, 4096, 4096)
    x = g.add_input("scores", F32, shape)
    s = g.add_constant(TensorData.from_array(np.float32(0.125)), "scale")
    (m,) = g.add_node("Mul", [x, s]).outputs
    (p,) = g.add_node("Softmax", [m], attrs={"axis": -1}).outputs
    for v in (m, p):
        v.dtype, v.shape = F32, shape
    g.outputs.append(p)
    return g


def test_a_row_too_large_for_the_engine_is_priced_fused_only_where_a_plan_splits_it_small_enough():
    """The engine joins a softmax row with its trees only on fewer than FLAT_MAX elements. A
    module holds a device's part, so its view decides on the local size; the search sees whole
    arrays, so its nodes carry both prices and a strategy's split picks one."""
    from parc.ops.fusion import FLAT_MAX

    h100 = DEVICES["h100-80g"]
    big = _scaled_softmax(8)
    assert math.prod(big.outputs[0].shape) >= FLAT_MAX
    module = graph_work(big.nodes, h100, {"scores"})  # the module view: two kernels, the Mul's apart
    assert module[0] is not None and module[1] is not None
    search = of_graph(big, h100)
    assert all(w.flat == math.prod(big.outputs[0].shape) and w.unfused is not None for w in search)
    # whole on one device (or split in two: still too large), the search prices the two kernels
    for split in (1, 2):
        assert sum(w.seconds(h100, split=split) for w in search) == pytest.approx(
            sum(w.seconds(h100, split=split) for w in module))
    # split 8 ways, a device's part is one batch row: one kernel, as the module of it runs
    local = _scaled_softmax(1)
    kernel = graph_work(local.nodes, h100, {"scores"})
    assert kernel[0] is None  # the Mul runs inside the row's kernel
    assert sum(w.seconds(h100, split=8) for w in search) == pytest.approx(kernel[1].seconds(h100))
    assert sum(w.seconds(h100, split=8) for w in search) < sum(w.seconds(h100, split=8) for w in module)
    # under the limit nothing changes: no second price
    assert all(w.unfused is None and w.flat == 0 for w in of_graph(local, h100))


def test_a_training_steps_rows_too_large_whole_carry_both_prices(tmp_path):
    """Over a real training step whose attention rows have 2^30 elements or more: the forward
    row and the softmax gradient's kernel (its own four nodes and the trees beside it) carry
    their unfused work, and whole on one device the search's price is the module view's."""
    from parc.ir import importer
    from tests.helpers import parc

    path = tmp_path / "gpt.onnx"
    assert parc("models", "build", "gpt-tiny", "--set", "seq=16384", "--set", "batch=4", "--train", "adamw",
                "-o", str(path)).returncode == 0
    g = importer.load(str(path), {})
    h100 = DEVICES["h100-80g"]
    search = of_graph(g, h100)
    both = {n.name for n, w in zip(g.nodes, search) if w.unfused is not None}
    for layer in ("h.0", "h.1"):
        assert {f"{layer}.attn.softmax", f"{layer}.attn.scale", f"{layer}.attn.softmax.grad.ReduceSum_0",
                f"{layer}.attn.softmax.grad.Sub_0", f"{layer}.attn.scale.grad.Mul_0"} <= both, sorted(both)
    whole = of_graph(g, h100, spread=False)  # the kernels whole, as a module of the whole step runs them
    assert sum(w.seconds(h100) for w in search) == pytest.approx(sum(w.seconds(h100) for w in whole if w is not None),
                                                                  rel=1e-9)
