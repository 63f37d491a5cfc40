"""medusa-build --backend tensorrt: the TensorRT engine builder, its ONNX rewrite and the tree-attention plugin."""
