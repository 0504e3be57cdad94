"""Developer tools: checkpoint generation (``serval make-model``) and friends."""
