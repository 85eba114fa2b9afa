"""Row norms: the residual add + RMSNorm from split-K partials, and the gather of rows + RMSNorm."""
