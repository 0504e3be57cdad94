"""Multi-LoRA: PEFT adapters over one base model, batched per token (see ``engine.lora.manager``)."""
