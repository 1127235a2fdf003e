"""The GPU engine's fusion on PyTorch exports (both exporters): each export's training step, in
float32 and bf16, run by the array engine on NumPy with its kernels' grouping (elementwise trees,
row steps with the trees beside them, casts in trees) equals the step run node by node, to the
bit; every row step's kernel applies to the step's arrays; and every CUDA source the grouping
generates for them compiles (NVRTC, no GPU needed). The kernels themselves run in
`tests/exec/test_gpu.py` on a GPU."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from parc.exec.engines import fusion, tree_kernel
from parc.exec.engines.array import ArrayEngine
from tests.helpers import flat_source_of, parc
from tests.nvrtc import compile_cuda

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.with_torch.test_torch_exports import CASES  # noqa: E402

pytestmark = [pytest.mark.torch]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, indirect=True)
def test_fused_step_equals_unfused_and_its_kernels_compile(case, precision, tmp_path, monkeypatch):
    dims = [f"--dim={k}={v}" for k, v in case["dims"].items()]
    step = tmp_path / "train.onnx"
    res = parc("grad", str(case["dir"] / case["onnx"]), "--precision", precision, *dims, "-o", str(step))
    assert res.returncode == 0, res.stderr
    model = onnx.load(step)
    samples = dict(np.load(case["dir"] / f"{case['onnx'].split('-')[0]}.npz"))
    feeds = {k: v for k, v in samples.items() if k in {i.name for i in model.graph.input}}

    sources, refused = {}, []
    row_call, group_call = fusion.RowGroup.__call__, tree_kernel.Group.__call__

    def record_row(self, *args):
        run = self.launch(dict(zip(self.leaves, args)))
        if run is None:
            refused.append(self.op)
        else:
            trees = [t and (t.types, t.modes) for t in (run.before, run.after)]
            sources[("row", self.op, *trees, run.per, run.out)] = self.source(run)
        return row_call(self, *args)

    def record_group(self, *leaves):
        made = flat_source_of(self, leaves)
        if made is not None:
            sources[made[0]] = made[1]
        return group_call(self, *leaves)

    monkeypatch.setattr(fusion.RowGroup, "__call__", record_row)
    monkeypatch.setattr(tree_kernel.Group, "__call__", record_group)
    fused = ArrayEngine(model, fuse=True)
    got, want = fused.run(feeds), ArrayEngine(model, fuse=False).run(feeds)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    rows = [s[0] for s in fused._steps if isinstance(s[0], fusion.RowGroup)]
    assert rows and not refused  # each family's softmax takes in a tree (its mask, scale or loss)
    for source in sources.values():
        compile_cuda(source, ("--std=c++14", "--fmad=false"))
