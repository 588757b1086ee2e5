"""Tokenizers, text sources and the stateful loader that turns them into batches."""
