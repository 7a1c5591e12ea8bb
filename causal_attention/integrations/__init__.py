"""Integrations of causal_attention with other libraries; each imports its library only when
used, so none of them is a dependency of the package."""
