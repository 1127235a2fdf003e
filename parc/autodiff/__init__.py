"""Training graphs: reverse-mode autodiff over the IR and optimizers as ONNX ops."""

from parc.autodiff.engine import differentiate
from parc.autodiff.optimizers import OPTIMIZERS, OptimizerConfig
from parc.autodiff.step import TrainingStep, make_training_step

__all__ = ["OPTIMIZERS", "OptimizerConfig", "TrainingStep", "differentiate", "make_training_step"]
