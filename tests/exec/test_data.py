"""`parc.exec.data.synthetic`: the batches `parc run` and `parc verify` draw."""

import numpy as np
from onnx import TensorProto

from parc.exec.data import PADDED, synthetic


def _input(name, shape, dtype, high=None):
    return {"name": name, "shape": list(shape), "dtype": dtype, "high": high}


def test_masks_are_drawn_as_padding_and_indices_below_their_table():
    inputs = [_input("input_ids", (16, 64), TensorProto.INT64, 1000),
              _input("attention_mask", (16, 64), TensorProto.INT64),  # indexes no table
              _input("looked_up_mask", (16, 64), TensorProto.INT64, 2),  # an export's table of two
              _input("keep", (16, 64), TensorProto.BOOL),
              _input("labels", (16,), TensorProto.INT64, 2),  # binary labels stay uniform
              _input("x", (16, 8), TensorProto.FLOAT)]
    batch = synthetic(inputs, 0, 0)
    ids = batch["input_ids"]
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 1000 and len(np.unique(ids)) > 500
    for name in ("attention_mask", "looked_up_mask", "keep"):
        m = batch[name].astype(np.int64)
        kept = m.sum(-1)
        assert (m == (np.arange(64) < kept[:, None])).all(), name  # ones, then zeros
        assert kept.min() >= 64 - 64 // PADDED and (kept < 64).any(), name
    assert batch["keep"].dtype == np.bool_
    assert 3 <= batch["labels"].sum() <= 13  # not drawn as padding: about half are ones
    assert batch["x"].dtype == np.float32
    # the same draw on every rank, another for another step (of the pool)
    assert all((synthetic(inputs, 0, 0)[k] == v).all() for k, v in batch.items())
    assert not (synthetic(inputs, 0, 1)["attention_mask"] == batch["attention_mask"]).all()
