"""The machine eyas runs on and the person at it: CPU threads (`cpu`), GPUs and what holds
them (`gpu`, from `nvidia-smi`), and progress and messages on the terminal or in a log
(`ui`).

May import: `eyas.run` (sizes and durations in words), and nothing else of eyas.
"""
