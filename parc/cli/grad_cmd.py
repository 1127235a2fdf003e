"""`parc grad MODEL -o TRAIN.onnx`: a training step (forward, backward, optimizer) in ONNX."""

from __future__ import annotations

import time
from pathlib import Path

import click

from parc.errors import UsageError


def _betas(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        b1, b2 = (float(p) for p in parts)
    except ValueError:
        raise UsageError(f"--betas {text!r}: expected two numbers, e.g. 0.9,0.999") from None
    return b1, b2


@click.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Training step .onnx to write.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE", help="Bind a symbolic dim.")
@click.option("--loss", help="Output to minimise (default: `loss`, else the only scalar float output).")
@click.option("--params", "params", metavar="REGEX", help="Train only parameters whose name matches.")
@click.option("--frozen", metavar="REGEX", help="Do not train parameters whose name matches.")
@click.option("--optimizer", default="sgd", type=click.Choice(["sgd", "momentum", "adam", "adamw"]),
              show_default=True)
@click.option("--lr", default=1e-3, type=float, show_default=True, help="Learning rate.")
@click.option("--weight-decay", default=0.0, type=float, show_default=True,
              help="L2 (sgd, momentum, adam) or decoupled (adamw) weight decay.")
@click.option("--momentum", default=0.9, type=float, show_default=True, help="Momentum (momentum).")
@click.option("--betas", default="0.9,0.999", show_default=True, help="Adam's B1,B2.")
@click.option("--eps", default=1e-8, type=float, show_default=True, help="Adam's epsilon.")
@click.option("--recompute/--no-recompute", default=True, show_default=True,
              help="Recompute cheap elementwise values (GELU's, a layer norm's) in the backward pass "
                   "instead of keeping them from the forward pass.")
@click.option("--precision", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16", "fp16"]),
              help="What matrix products (MatMul, Gemm, Conv, Einsum) compute in; parameters, the optimizer "
                   "and every other node stay float32 (mixed precision, docs/training.md).")
@click.option("--loss-scale", type=float, default=None,
              help="Static loss scale, a power of two: the loss's gradient is multiplied by it and each "
                   "gradient divided again before the optimizer. Default: 1024 with fp16, else 1.")
def grad(model: str, output: str, dims: tuple[str, ...], loss: str | None, params: str | None,
         frozen: str | None, optimizer: str, lr: float, weight_decay: float, momentum: float,
         betas: str, eps: float, recompute: bool, precision: str, loss_scale: float | None) -> None:
    """Write a training step for MODEL: its loss, gradients and an optimizer update."""
    from parc.autodiff import OptimizerConfig, make_training_step
    from parc.ir import importer, save
    from parc.ir.state import step_state

    src, out = Path(model).resolve(), Path(output).resolve()
    if out == src or out.parent / (out.name + ".data") == src or \
            (src.parent / (src.name + ".data")) == out.parent / (out.name + ".data"):
        raise UsageError(f"-o {output}: would overwrite the input model or its weights")
    cfg = OptimizerConfig(optimizer, lr, weight_decay, momentum, _betas(betas), eps)
    t = time.perf_counter()
    graph = importer.load(model, importer.parse_dims(dims))
    step = make_training_step(graph, cfg, loss=loss, params=params, frozen=frozen, recompute=recompute,
                              precision=precision, loss_scale=loss_scale)
    save(graph, output)
    mixed = step_state(graph.metadata).precision  # type: ignore[union-attr]
    click.echo(f"wrote {output}: loss '{step.loss}', {len(step.params)} parameters, optimizer "
               f"{optimizer}, {len(graph.nodes)} nodes"
               + (f", {mixed['products']} products in {precision} (loss scale {mixed['loss_scale']:g})" if mixed else "")
               + f" ({time.perf_counter() - t:.1f} s)")
