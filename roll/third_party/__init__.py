"""The only code that touches a library's internals (DeepSpeed, vLLM, SGLang, transformers' import).

May import: everything below `roll.distributed.strategy`.
"""
