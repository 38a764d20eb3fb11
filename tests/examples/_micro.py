"""The micro decoder config that the example tests build: 2 layers of width 32 (fast on a CPU)."""

from jaxtier.examples import llama


MICRO = llama.LlamaConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64,
                          max_seq_len=32)
