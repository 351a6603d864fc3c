"""Model and tokenizer providers (Hugging Face and the local `tiny://` factory) and weight loading.

May import: `roll.configs`, `roll.platforms`, `roll.utils`.
"""
