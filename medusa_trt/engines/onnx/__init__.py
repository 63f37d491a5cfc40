"""The ONNX graph writer shared by the ONNX Runtime and TensorRT backends: export, attention forms, quantized ops."""
