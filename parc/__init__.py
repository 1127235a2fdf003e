"""parc: automatic parallelization of ONNX training and inference programs."""

__version__ = "0.1.0"
