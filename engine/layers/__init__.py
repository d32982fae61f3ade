"""Building blocks of the models: linears (incl. tensor-parallel), attention, norms, rotary embeddings."""
