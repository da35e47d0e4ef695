"""The torch engine and its models on the CPU: ``decode_speed`` (per dtype, beside its limits),
``perplexity`` (the paragraphs every format is scored on), ``speculative`` (drafts against none),
``hf_load_memory`` (peak memory of a Hugging Face checkpoint's load)."""
