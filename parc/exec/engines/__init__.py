"""Engines that run one ONNX module of a plan: parc's own array interpreter (`array`)."""
