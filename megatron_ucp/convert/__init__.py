"""Converters between the universal format and megatron's own (legacy torch, torch_dist) and
Hugging Face folders, sharing one writer. Imports the layers below; never the training
application, whose worker processes they start by module name."""
