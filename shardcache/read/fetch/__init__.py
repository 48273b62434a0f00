"""fetch stage of the read pipeline."""
