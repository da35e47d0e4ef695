"""Console entry points (``trtllm-serve``)."""
