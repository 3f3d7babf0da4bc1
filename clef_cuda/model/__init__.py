"""The model: release config and weights, the Qwen3.5 trunk, the joint schema head, the vision tower,
fine-tuned variants (LoRA adapters) and the embedded default model."""
