"""The lab beside the engine: the Qwen3 check, the benchmark, memory and timing, the CLI.

Nothing here is imported by `import attnlib`; the Qwen3 modules need transformers.
"""
