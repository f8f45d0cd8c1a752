"""The megatron-core glue: the mapping from a GPT model to atomic tensors (from its own
sharded_state_dict), the optimizer's state through its accessors, RNG trackers, the CPU/gloo
mode and version fixes, Megatron-LM's flags and the model built from them. Imports the format."""
