"""Workers: one per device. A worker owns a model runner, which owns the model and its KV cache."""
