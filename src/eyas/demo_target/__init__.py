"""The built-in demo target: tiny transformers models built from configs, the demo
conversations, and the trained demo target shipped in `assets/`."""
