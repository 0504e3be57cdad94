"""Building blocks: linear layers with a TP loading seam, RMSNorm, rotary embedding, MLP, attention."""
