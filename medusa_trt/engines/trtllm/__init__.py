"""medusa-build --backend tensorrt-llm: trtllm-build on the merged checkpoint."""
