"""Serving with Triton Inference Server: model repositories (medusa-triton) and a local server
(medusa-serve). Heavy imports (torch, transformers, tritonclient) stay inside the modules that need
them, so writing a repository needs neither."""
