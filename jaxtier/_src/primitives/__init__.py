"""One module per XLA FFI custom-call family (Python side: program, lowering, reference)."""
