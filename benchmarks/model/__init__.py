"""The torch engine and its models on the CPU: ``decode_speed`` (every weight format beside its
roofline), ``cpu_decode_profile`` (where a decode step's time goes), ``gguf_variants`` (the packaged
GGUF file rewritten in Q8_0 / Q4_0), ``perplexity`` (the paragraphs every format is scored on),
``speculative`` (drafts against none), ``hf_load_memory`` (peak memory of a Hugging Face checkpoint's load)."""
