"""Models and their files: the model catalog, GGUF and safetensors readers, artifacts made on demand."""
