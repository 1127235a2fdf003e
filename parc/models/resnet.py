"""Bottleneck ResNets: ResNet50 with 100K / 1M-class heads (Whale 5.1.2) and Alpa's
Wide-ResNet (Rhino Table 4).

One network covers both. Stem: 7x7/2 conv, BatchNorm, ReLU, 3x3/2 max-pool. Stage i (sizes by
depth: 50 -> 3,4,6,3; 101 -> 3,4,23,3) uses F = channels * 2**i and bottleneck blocks

    1x1 conv -> F,  3x3 conv (stride) -> F * width_factor,  1x1 conv -> 4F,
    projection shortcut (1x1 conv + BN) where the shape changes,

each conv followed by BatchNorm (+ ReLU), then global average pool and a Gemm classifier.
With channels=64, width_factor=1 this is torchvision's ResNet50 (v1.5, stride on the 3x3);
with width_factor > 1 it is Alpa's `BottleneckResNetBlock` (alpa/model/wide_resnet.py), whose
benchmark (1024 classes) Rhino's Wide-ResNet configurations follow.
BatchNorm is inference-mode (running statistics are initializers named *.running_mean/var,
not counted as parameters). Inputs ``images`` float32 [batch, 3, image, image], ``labels`` [batch].
"""

from __future__ import annotations

from onnx import TensorProto

from parc.models.config import Config, check, common_defaults
from parc.models.layers import ModelBuilder

FAMILY = "resnet"
FAMILIES = {n: "wide-resnet" for n in ("wr-1.3b", "wr-2.6b", "wr-6b", "wr-12b", "wr-tiny")}
STAGE_SIZES = {26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


def _defaults(depth: int, channels: int, width_factor: int, classes: int, batch: int, *, image: int = 224,
              weights: str = "sparse") -> dict[str, object]:
    return {"depth": depth, "channels": channels, "width_factor": width_factor, "classes": classes,
            "image": image, **common_defaults(batch, weights)}


MODELS = [
    ("resnet50-100k", "ResNet50 with a 100K-class FC head (Whale 5.1.2: 90 MB + 782 MB)", 228_600_000,
     _defaults(50, 64, 1, 100_000, 32)),
    ("resnet50-1m", "ResNet50 with a 1M-class FC head (Whale 5.1.2; size derived, see docs)", 2_073_600_000,
     _defaults(50, 64, 1, 1_000_000, 32)),
    ("resnet-tiny", "ResNet50 layout at 1/8 width, 32x32 images, 10 classes, for tests (random weights)", None,
     _defaults(50, 8, 1, 10, 2, image=32, weights="random")),
    ("wr-1.3b", "Wide-ResNet50, 320 channels, width 2 (Rhino Table 4; Alpa's net is 1.0B, see docs)", 1_300_000_000,
     _defaults(50, 320, 2, 1024, 4)),
    ("wr-2.6b", "Wide-ResNet50, 448 channels, width 2 (Rhino Table 4; Alpa's net is 2.0B, see docs)", 2_600_000_000,
     _defaults(50, 448, 2, 1024, 4)),
    ("wr-6b", "Wide-ResNet50, 640 channels, width 2 (Rhino Table 4; Alpa's net is 4.0B, see docs)", 6_000_000_000,
     _defaults(50, 640, 2, 1024, 4)),
    ("wr-12b", "Wide-ResNet101, 320 channels, width 12 (Rhino Table 4; Alpa's net is 9.6B, see docs)", 12_000_000_000,
     _defaults(101, 320, 12, 1024, 4)),
    ("wr-tiny", "Wide-ResNet50 layout, 8 channels, width 2, 32x32 images, for tests (random weights)", None,
     _defaults(50, 8, 2, 10, 2, image=32, weights="random")),
]


def validate(cfg: Config) -> None:
    """Reject configurations the graph cannot be built for."""
    check(cfg["depth"] in STAGE_SIZES, f"depth={cfg['depth']} must be one of {', '.join(map(str, STAGE_SIZES))}")
    check(cfg["image"] % 32 == 0, f"image={cfg['image']} must be a multiple of 32 (total stride 32)")


def bottleneck(b: ModelBuilder, x: str, cin: int, f: int, width: int, stride: int, name: str) -> str:
    """Bottleneck block cin -> 4f; the 3x3 conv carries the stride and the width factor."""
    y = b.conv_bn(x, cin, f, 1, f"{name}.conv1")
    y = b.conv_bn(y, f, f * width, 3, f"{name}.conv2", stride=stride)
    y = b.conv_bn(y, f * width, 4 * f, 1, f"{name}.conv3", relu=False, zero_init=True)
    shortcut = x
    if cin != 4 * f or stride != 1:
        shortcut = b.conv_bn(x, cin, 4 * f, 1, f"{name}.downsample", stride=stride, relu=False)
    return b.relu(b.add(y, shortcut, f"{name}.residual"), f"{name}.relu")


def build(b: ModelBuilder, cfg: Config) -> None:
    """Build the ResNet forward + loss graph into `b`."""
    bs, img, c, n = cfg["batch"], cfg["image"], cfg["channels"], cfg["classes"]
    x = b.input("images", TensorProto.FLOAT, [bs, 3, img, img])
    labels = b.input("labels", TensorProto.INT64, [bs])
    x = _stem(b, x, c)
    cin = c
    for i, blocks in enumerate(STAGE_SIZES[cfg["depth"]]):
        f = c * 2**i
        for j in range(blocks):
            stride = 2 if i > 0 and j == 0 else 1
            x = bottleneck(b, x, cin, f, cfg["width_factor"], stride, f"layer{i + 1}.{j}")
            cin = 4 * f
    x = b.op("GlobalAveragePool", [x], "pool.global_average")
    x = b.op("Flatten", [x], "pool.flatten", axis=1)
    w = b.param("fc.weight", [cin, n], std=0.01)
    b.op("Gemm", [x, w, b.param("fc.bias", [n], "zeros")], "fc.gemm", outputs=["logits"])
    b.classify_loss("logits", labels)
    b.output("loss", TensorProto.FLOAT, [])
    b.output("logits", TensorProto.FLOAT, [bs, n])


def _stem(b: ModelBuilder, x: str, c: int) -> str:
    """7x7/2 conv (padding 3), BatchNorm, ReLU, 3x3/2 max-pool (padding 1)."""
    y = b.conv(x, 3, c, 7, "stem.conv", stride=2, pad=3)
    y = b.relu(b.batch_norm(y, c, "stem.conv.bn"), "stem.relu")
    return b.max_pool(y, 3, 2, "stem.maxpool", pad=1)
