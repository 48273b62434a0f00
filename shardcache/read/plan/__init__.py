"""plan stage of the read pipeline."""
