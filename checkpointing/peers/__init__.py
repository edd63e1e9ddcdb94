"""Other trainers' checkpoints and weights files, read without running their code: Composer, Lightning, Hugging
Face, Ray, MindSpore, safetensors and plain state dicts (``formats`` is the entry point)."""
