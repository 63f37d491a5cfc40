"""medusa-build --backend onnxruntime: the ONNX Runtime engine builder, its graph fusions and shared weights."""
