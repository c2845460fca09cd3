"""Building blocks of the models: tensor-parallel linear and embedding layers, norms,
rotary embedding, gated activations and paged attention."""
