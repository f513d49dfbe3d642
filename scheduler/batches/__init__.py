"""Batches: many job specs in one transaction (``service``), and OpenAI's Batch API on top of them
(``openai_batches``).
"""
