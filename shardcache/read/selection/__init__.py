"""selection stage of the read pipeline."""
