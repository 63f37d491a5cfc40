"""Tree-attention kernel (Triton), its PyTorch reference, and its TensorRT plugin registration."""
