"""samples stage of the read pipeline."""
