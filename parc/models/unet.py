"""UNet (Rhino Table 3, 33M): a diffusion-style residual UNet without attention.

Stem 3x3 conv, then per level (widths base * mults) `res_blocks` residual blocks, whose output
is the level's skip, and a 2x2 stride-2 conv down to the next level; `mid_blocks` residual
blocks at the bottom; on the way up a 2x2 stride-2 ConvTranspose, Concat with the skip, and
`res_blocks` residual blocks; a 1x1 conv to `classes` per-pixel logits. A residual block is
conv3x3-BN-ReLU-conv3x3-BN plus the input (through a 1x1 conv when the width changes), ReLU.
There is no timestep embedding or attention; the loss is per-pixel SoftmaxCrossEntropyLoss
(segmentation-style), so the labels are int64 [batch, image, image].
Inputs ``images`` float32 [batch, in_channels, image, image].
"""

from __future__ import annotations

from onnx import TensorProto

from parc.models.config import Config, check, common_defaults
from parc.models.layers import ModelBuilder

FAMILY = "unet"


def _defaults(base: int, mults: tuple[int, ...], res_blocks: int, mid_blocks: int, image: int, batch: int, *,
              classes: int = 2, weights: str = "sparse") -> dict[str, object]:
    return {"base": base, "mults": mults, "res_blocks": res_blocks, "mid_blocks": mid_blocks, "in_channels": 3,
            "classes": classes, "image": image, **common_defaults(batch, weights)}


MODELS = [
    ("unet", "Residual UNet, widths 64-512, no attention (Rhino Table 3: 33M)", 33_000_000,
     _defaults(64, (1, 2, 4, 8), 2, 1, 256, 16)),
    ("unet-tiny", "3-level residual UNet, widths 8-32, 32x32 images, for tests (random weights)", None,
     _defaults(8, (1, 2, 4), 1, 1, 32, 2, weights="random")),
]


def validate(cfg: Config) -> None:
    """Reject configurations the graph cannot be built for."""
    down = 2 ** (len(cfg["mults"]) - 1)
    check(cfg["image"] % down == 0, f"image={cfg['image']} must be a multiple of {down} (one halving per level)")


def res_block(b: ModelBuilder, x: str, cin: int, cout: int, name: str) -> str:
    """conv3x3-BN-ReLU-conv3x3-BN plus a (projected) shortcut, then ReLU."""
    y = b.conv_bn(x, cin, cout, 3, f"{name}.conv1")
    y = b.conv_bn(y, cout, cout, 3, f"{name}.conv2", relu=False, zero_init=True)
    shortcut = b.conv(x, cin, cout, 1, f"{name}.shortcut", bias=True) if cin != cout else x
    return b.relu(b.add(y, shortcut, f"{name}.residual"), f"{name}.relu")


def build(b: ModelBuilder, cfg: Config) -> None:
    """Build the UNet forward + loss graph into `b`."""
    bs, img, n = cfg["batch"], cfg["image"], cfg["classes"]
    widths = [cfg["base"] * m for m in cfg["mults"]]
    x = b.input("images", TensorProto.FLOAT, [bs, cfg["in_channels"], img, img])
    labels = b.input("labels", TensorProto.INT64, [bs, img, img])
    x = b.conv(x, cfg["in_channels"], widths[0], 3, "stem", bias=True)
    cin, skips = widths[0], []
    for lvl, ch in enumerate(widths):
        for r in range(cfg["res_blocks"]):
            x = res_block(b, x, cin, ch, f"down.{lvl}.res.{r}")
            cin = ch
        skips.append((x, ch))
        if lvl + 1 < len(widths):
            x = b.conv(x, ch, ch, 2, f"down.{lvl}.downsample", stride=2, pad=0, bias=True)
    for r in range(cfg["mid_blocks"]):
        x = res_block(b, x, cin, cin, f"mid.res.{r}")
    for lvl in reversed(range(len(widths))):
        skip, ch = skips[lvl]
        if lvl + 1 < len(widths):
            x = b.conv_transpose(x, cin, ch, 2, 2, f"up.{lvl}.upsample")
            cin = ch
        x = b.op("Concat", [x, skip], f"up.{lvl}.concat", axis=1)
        cin += ch
        for r in range(cfg["res_blocks"]):
            x = res_block(b, x, cin, ch, f"up.{lvl}.res.{r}")
            cin = ch
    b.conv(x, cin, n, 1, "head", bias=True)
    b.op("Identity", ["head.conv"], "logits.identity", outputs=["logits"])
    b.classify_loss("logits", labels)
    b.output("loss", TensorProto.FLOAT, [])
    b.output("logits", TensorProto.FLOAT, [bs, n, img, img])
