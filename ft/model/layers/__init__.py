"""Layers of the model: gated attention, Gated DeltaNet, sparse MoE, norms, rotary, linear; each
calls `ft.kernels` dispatchers."""
