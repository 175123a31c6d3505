"""Span signals derived from the response tokens (e.g. the reasoning span before the final answer)."""
