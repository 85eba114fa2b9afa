"""The skinny matmul (one weight-streaming pass for a few rows) and its tilings."""
