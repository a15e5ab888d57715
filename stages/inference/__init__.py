"""Inference: generation, evaluation, export and the chat server."""
