"""Commands around training: text generation, plots."""
