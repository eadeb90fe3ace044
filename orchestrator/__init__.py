"""fabtrain: launch, check, watch and stop multi-node PyTorch training in Docker over SSH."""
