"""Developer tools: the checkpoints and adapters tests and benchmarks run on (``serval make-model``).

Modules: ``make_model`` (the command; random-weight checkpoints), ``checkpoint`` (what every model maker
writes besides weights: size presets, config, tokenizer, the spec file and its up-to-date check),
``weights`` (deterministic random weights), ``tokenizer_trainer`` (a byte-level BPE tokenizer trained on the
stdlib, with its chat template), ``train_model`` (``--train``: the trained target/draft pair),
``distill`` (the draft's distillation from the target), ``make_adapter`` (``--lora``: random PEFT adapters),
``quantize_gguf`` (``serval quantize-gguf``: a GGUF file with its linear weights re-encoded).
"""
