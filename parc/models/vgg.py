"""VGG19 with a configurable (by default million-class) classifier, Rhino Table 3.

Sixteen 3x3 convolutions with bias and ReLU in five stages, each closed by a 2x2 max-pool,
then three fully connected layers (fc1, fc2 with ReLU; fc3 to `classes`). Dropout is left out
(it is the identity at inference and has no parameters). ``base`` scales every conv width
(64 for VGG19), ``fc`` the two hidden FC layers (4096).
Inputs ``images`` float32 [batch, 3, image, image], ``labels`` int64 [batch].
"""

from __future__ import annotations

from onnx import TensorProto

from parc.models.config import Config, check, common_defaults
from parc.models.layers import ModelBuilder

FAMILY = "vgg"
# VGG19 ("E"): per stage, how many convs and their width as a multiple of base.
STAGES = ((2, 1), (2, 2), (4, 4), (4, 8), (4, 8))


def _defaults(classes: int, image: int, batch: int, *, base: int = 64, fc: int = 4096,
              weights: str = "sparse") -> dict[str, object]:
    return {"classes": classes, "image": image, "base": base, "fc": fc, **common_defaults(batch, weights)}


MODELS = [
    ("vgg19", "VGG19 with a 1,000,000-class classifier (Rhino Table 3: 4.2B)", 4_200_000_000,
     _defaults(1_000_000, 224, 128)),
    ("vgg-tiny", "VGG19 layout at 1/16 width, 32x32 images, 10 classes, for tests (random weights)", None,
     _defaults(10, 32, 2, base=4, fc=32, weights="random")),
]


def validate(cfg: Config) -> None:
    """Reject configurations the graph cannot be built for."""
    check(cfg["image"] % 32 == 0, f"image={cfg['image']} must be a multiple of 32 (five 2x2 max-pools)")


def build(b: ModelBuilder, cfg: Config) -> None:
    """Build the VGG19 forward + loss graph into `b`."""
    bs, img, n = cfg["batch"], cfg["image"], cfg["classes"]
    x = b.input("images", TensorProto.FLOAT, [bs, 3, img, img])
    labels = b.input("labels", TensorProto.INT64, [bs])
    cin = 3
    for s, (convs, mult) in enumerate(STAGES, start=1):
        cout = cfg["base"] * mult
        for c in range(1, convs + 1):
            name = f"features.conv{s}_{c}"
            x = b.relu(b.conv(x, cin, cout, 3, name, bias=True), f"{name}.relu")
            cin = cout
        x = b.max_pool(x, 2, 2, f"features.pool{s}")
    side = img // 32
    x = b.op("Flatten", [x], "classifier.flatten", axis=1)
    x = b.relu(b.gemm(x, cin * side * side, cfg["fc"], "classifier.fc1", std=0.01), "classifier.fc1.relu")
    x = b.relu(b.gemm(x, cfg["fc"], cfg["fc"], "classifier.fc2", std=0.01), "classifier.fc2.relu")
    w = b.param("classifier.fc3.weight", [cfg["fc"], n], std=0.01)
    bias = b.param("classifier.fc3.bias", [n], "zeros")
    b.op("Gemm", [x, w, bias], "classifier.fc3.gemm", outputs=["logits"])
    b.classify_loss("logits", labels)
    b.output("loss", TensorProto.FLOAT, [])
    b.output("logits", TensorProto.FLOAT, [bs, n])
