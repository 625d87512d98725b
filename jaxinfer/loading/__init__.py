"""Model files to model inputs: GGUF and safetensors to (ModelConfig, Params), and the tokenizer."""
