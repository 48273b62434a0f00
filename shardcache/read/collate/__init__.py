"""collate stage of the read pipeline."""
